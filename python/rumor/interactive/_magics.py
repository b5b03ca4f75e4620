"""IPython magics: %%rumor, %%rank0, %rumor_status."""
from __future__ import annotations

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import _session


@magics_class
class RumorMagics(Magics):
    @magic_arguments()
    @argument("--timeout", type=float, default=None,
              help="rumor's deadline for every wait in this cell, and the cell's own limit "
                   "(S + 10 s, then busy ranks are interrupted); default: start()'s timeout")
    @argument("--ranks", type=str, default=None, help="comma-separated ranks (default: all)")
    @cell_magic
    def rumor(self, line, cell):
        """Runs the cell on every rank; each output line starts with [rank r]."""
        args = parse_argstring(self.rumor, line)
        if args.timeout is not None and not args.timeout > 0:
            raise ValueError(f"%%rumor: --timeout must be positive, got {args.timeout}")
        s = _session.current()
        ranks = None
        if args.ranks:
            ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
            bad = [r for r in ranks if not 0 <= r < s.n]
            if bad:
                raise ValueError(f"%%rumor: --ranks {bad} are outside 0..{s.n - 1}")
        if s.broken:
            print(f"rumor.interactive: warning: {s.broken}; rumor.interactive.restart() re-initialises it")
        s.execute(cell, ranks=ranks, timeout=args.timeout)

    @magic_arguments()
    @argument("--timeout", type=float, default=None,
              help="rumor's deadline in this cell; the cell may run S + 10 s")
    @cell_magic
    def rank0(self, line, cell):
        """Runs the cell on rank 0 only (its output is shown without a prefix)."""
        args = parse_argstring(self.rank0, line)
        if args.timeout is not None and not args.timeout > 0:
            raise ValueError(f"%%rank0: --timeout must be positive, got {args.timeout}")
        _session.current().execute(cell, ranks=[0], timeout=args.timeout, prefix=False)

    @line_magic
    def rumor_status(self, line):
        """Ranks, hosts, pids, and what each is doing."""
        s = _session.current()
        rows = s.status()
        print(f"rumor.interactive: {s.n} rank(s), rumor timeout {s.timeout:g} s"
              + (f"; {s.dead}" if s.dead else "") + (f"; {s.broken}" if s.broken else ""))
        print(f"{'rank':>4}  {'host':<20} {'pid':>8} {'engine':>6}  state")
        for r in rows:
            print(f"{r['rank']:>4}  {r['host']:<20} {r['pid']:>8} {r['engine']:>6}  {r['state']}")
