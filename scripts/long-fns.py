#!/usr/bin/env python3
"""List Rust functions longer than a limit (default 100 lines), outside tests.

Why this exists: ARCHITECTURE.md promises no function over ~100 lines outside tests and
generated tables unless a one-line reason stands next to it. A function may carry the reason as
a comment containing `long-fn:` on one of the three lines above its `fn` line; this script then
lists it as excused instead of failing. Exit 1 when an unexcused function is over the limit.

Usage: scripts/long-fns.py [--limit N] [--all] [ROOT ...]
"""
import os
import re
import sys

FN_RE = re.compile(r'^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+"[^"]*"\s+)?fn\s+(\w+)')


def strip_code(line, state):
    """Remove string/char literals and comments so braces can be counted. state: in block comment."""
    out = []
    i = 0
    n = len(line)
    while i < n:
        if state["block"]:
            j = line.find("*/", i)
            if j < 0:
                return "".join(out)
            state["block"] = False
            i = j + 2
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state["block"] = True
            i += 2
            continue
        if c == '"' or (c == 'r' and re.match(r'r#*"', line[i:]) and (i == 0 or not (line[i-1].isalnum() or line[i-1] == '_'))):
            if c == 'r':
                m = re.match(r'r(#*)"', line[i:])
                hashes = m.group(1)
                end = '"' + hashes
                j = line.find(end, i + len(m.group(0)))
                if j < 0:
                    state["raw"] = end
                    return "".join(out)
                i = j + len(end)
                continue
            j = i + 1
            while j < n:
                if line[j] == '\\':
                    j += 2
                    continue
                if line[j] == '"':
                    break
                j += 1
            if j >= n:
                state["str"] = True
                return "".join(out)
            i = j + 1
            continue
        if c == "'":
            m = re.match(r"'(\\.|[^\\'])[^']*?'", line[i:])
            if m and len(m.group(0)) <= 12:
                i += len(m.group(0))
                continue
        out.append(c)
        i += 1
    return "".join(out)


def scan(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    state = {"block": False, "str": False, "raw": None}
    results = []
    stack = []  # (name, start_line, depth_at_open, excused)
    depth = 0
    test_depth = None
    pending_cfg_test = False
    for idx, raw in enumerate(lines):
        line = raw
        if state["str"]:
            j = 0
            while j < len(line):
                if line[j] == '\\':
                    j += 2
                    continue
                if line[j] == '"':
                    break
                j += 1
            if j >= len(line):
                continue
            state["str"] = False
            line = line[j + 1:]
        if state["raw"]:
            j = line.find(state["raw"])
            if j < 0:
                continue
            line = line[j + len(state["raw"]):]
            state["raw"] = None
        code = strip_code(line, state)
        if "#[cfg(test)]" in raw:
            pending_cfg_test = True
        m = FN_RE.match(raw)
        if m and test_depth is None:
            prev = "\n".join(lines[max(0, idx - 3):idx])
            stack.append([m.group(7), idx + 1, None, "long-fn:" in prev])
        for ch in code:
            if ch == "{":
                depth += 1
                if pending_cfg_test and test_depth is None:
                    test_depth = depth
                    pending_cfg_test = False
                if stack and stack[-1][2] is None:
                    stack[-1][2] = depth
            elif ch == "}":
                if stack and stack[-1][2] == depth:
                    name, start, _, excused = stack.pop()
                    results.append((name, start, idx + 1, excused))
                if test_depth == depth:
                    test_depth = None
                depth -= 1
            elif ch == ";":
                if stack and stack[-1][2] is None:
                    stack.pop()  # declaration without body
        if pending_cfg_test and code.strip().endswith(";"):
            pending_cfg_test = False
    return results


def main():
    args = sys.argv[1:]
    limit = 100
    show_all = False
    roots = []
    while args:
        a = args.pop(0)
        if a == "--limit":
            limit = int(args.pop(0))
        elif a == "--all":
            show_all = True
        else:
            roots.append(a)
    bad = 0
    for dirpath, dirnames, filenames in (w for r in (roots or ["."]) for w in os.walk(r)):
        dirnames[:] = [d for d in dirnames if d not in ("target", ".git", "tests")]
        for fn in filenames:
            if not fn.endswith(".rs") or fn == "tests.rs":
                continue
            p = os.path.join(dirpath, fn)
            for name, a, b, excused in scan(p):
                length = b - a + 1
                if length > limit:
                    tag = "excused" if excused else "TOO LONG"
                    if not excused:
                        bad += 1
                    if show_all or not excused:
                        print(f"{tag}\t{length}\t{p}:{a}\t{name}")
    print(f"{bad} function(s) over {limit} lines without a `long-fn:` reason")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
