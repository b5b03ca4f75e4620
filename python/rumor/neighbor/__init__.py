"""BlueFog's communication model: neighbor collectives over a topology (ops) and one-sided
windows with push-sum weights (window). The API is re-exported as rumor.neighbor_* and rumor.win_*."""
