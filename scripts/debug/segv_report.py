# Turns /tmp/segv-*.txt into function names: frames in rumor's _C module through addr2line
# (address minus the module's load base, read from the saved /proc/self/maps).
import glob
import re
import subprocess

for path in glob.glob("/tmp/segv-*.txt"):
    text = open(path).read()
    head, _, maps = text.partition("--- maps\n")
    bases = {}
    for m in maps.splitlines():
        parts = m.split()
        if len(parts) >= 6 and int(parts[2], 16) == 0 and parts[5] not in bases:
            bases[parts[5]] = int(parts[0].split("-")[0], 16)
    print("=====", path)
    spans = []  # (start, end, module) of every mapping of a rumor module
    for m in maps.splitlines():
        parts = m.split()
        if len(parts) >= 6 and "/rumor/" in parts[5] and parts[5] in bases:
            lo, hi = (int(v, 16) for v in parts[0].split("-"))
            spans.append((lo, hi, parts[5]))
    for line in head.splitlines():
        rip = re.match(r"rip \[(0x[0-9a-f]+)\]", line)
        where = [s for s in spans if rip and s[0] <= int(rip.group(1), 16) < s[1]]
        if where:
            mod = where[0][2]
            rel = hex(int(rip.group(1), 16) - bases[mod])
            r = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", mod, rel], capture_output=True, text=True)
            print(line, f"-> {mod} +{rel}:", " | ".join(x for x in r.stdout.split("\n")[:12] if x))
            continue
        m = re.match(r"(\S+?\.so[^(]*)\(.*\)\s*\[(0x[0-9a-f]+)\]", line)
        if m and "/rumor/" in m.group(1) and m.group(1) in bases:
            rel = hex(int(m.group(2), 16) - bases[m.group(1)])
            r = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", m.group(1), rel], capture_output=True, text=True)
            print(line[:200], "->", " | ".join(x for x in r.stdout.split("\n")[:8] if x))
        else:
            print(line[:200])
