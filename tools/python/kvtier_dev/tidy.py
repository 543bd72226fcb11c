"""kvtier's tidy check (issue 28 §3, in the spirit of TigerBeetle's `tidy.zig`).

Rules over the production Rust sources (`crates/*/src/**/*.rs`, items under `#[cfg(test)]`
excluded):

- a function is at most ``MAX_FUNCTION_LINES`` lines, from its ``fn`` line to its closing
  brace;
- ``unsafe`` appears only in the modules that open with ``#![allow(unsafe_code)]`` and are
  listed in the allow-list (the lint denies it elsewhere; this keeps the list reviewed);
- ``.expect(`` is not used (a panic on a path input can reach; say why with a typed error).

Existing exceptions live in ``tidy_allow.toml`` next to this file. The list may only shrink:
an entry that no longer needs its exception (a function now short enough, a module without
``unsafe``, fewer ``expect`` calls) fails the check too, so it is removed when it is fixed.

    python -m kvtier_dev.tidy           # report; exit 1 on a violation
    python -m kvtier_dev.tidy --write   # rewrite the allow-list to exactly today's exceptions
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

MAX_FUNCTION_LINES = 70
ROOT = Path(__file__).resolve().parents[3]
ALLOW_FILE = Path(__file__).with_name("tidy_allow.toml")

_FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")
_UNSAFE = re.compile(r"\bunsafe\b")
_EXPECT = re.compile(r"\.expect\(")
_CFG_TEST = re.compile(r"#\[cfg\((?:all\()?test\b")


def blank_comments_and_literals(text: str) -> str:
    """`text` with comments, string and char literals replaced by spaces (newlines kept), so
    braces and keywords inside them are not seen."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a: int, b: int) -> None:
        for k in range(a, min(b, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif c == "r" and re.match(r'r#*"', text[i:]) and not _ident_char(text, i - 1):
            m = re.match(r'r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + len(m.group(0)))
            j = n if j < 0 else j + len(end)
            blank(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            # A char literal ('a', '\n', '\u{..}'), not a lifetime ('a without a closing quote).
            m = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:])
            if m:
                blank(i, i + len(m.group(0)))
                i += len(m.group(0))
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def _ident_char(text: str, i: int) -> bool:
    return i >= 0 and (text[i].isalnum() or text[i] == "_")


def _matching_brace(code: str, open_at: int) -> int:
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(code) - 1


def production_code(code: str) -> str:
    """`code` (already blanked) with every item under `#[cfg(test)]` blanked too."""
    out = list(code)
    for m in _CFG_TEST.finditer(code):
        # The attribute's item: up to its first `;` (a `mod x;`) or its braced body.
        k = m.end()
        while k < len(code) and code[k] not in "{;":
            k += 1
        if k >= len(code):
            continue
        end = k if code[k] == ";" else _matching_brace(code, k)
        for j in range(m.start(), end + 1):
            if out[j] != "\n":
                out[j] = " "
    return "".join(out)


@dataclass(frozen=True)
class Function:
    path: str
    name: str
    line: int
    lines: int


def functions(path: str, code: str) -> list[Function]:
    found = []
    for m in _FN.finditer(code):
        # The body opens at the first `{` outside parentheses/brackets/generics after the
        # signature; a `;` first means a declaration without a body (trait, extern).
        depth, k = 0, m.end()
        while k < len(code):
            ch = code[k]
            if ch in "([<":
                depth += 1
            elif ch in ")]>":
                # `->` is not a closing bracket.
                if not (ch == ">" and code[k - 1] == "-"):
                    depth -= 1
            elif ch == ";" and depth <= 0:
                k = -1
                break
            elif ch == "{" and depth <= 0:
                break
            k += 1
        if k < 0 or k >= len(code):
            continue
        close = _matching_brace(code, k)
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, close) + 1
        found.append(Function(path, m.group(1), first, last - first + 1))
    return found


@dataclass
class Findings:
    long_functions: dict[str, int]
    unsafe_modules: set[str]
    expect_calls: dict[str, int]


def scan(root: Path = ROOT) -> Findings:
    findings = Findings({}, set(), {})
    for file in sorted(root.glob("crates/*/src/**/*.rs")):
        rel = file.relative_to(root).as_posix()
        code = production_code(blank_comments_and_literals(file.read_text()))
        for f in functions(rel, code):
            if f.lines > MAX_FUNCTION_LINES:
                key = f"{rel}::{f.name}"
                # Several long functions of one name in a file: keep the longest.
                findings.long_functions[key] = max(findings.long_functions.get(key, 0), f.lines)
        if _UNSAFE.search(code):
            findings.unsafe_modules.add(rel)
        expects = len(_EXPECT.findall(code))
        if expects:
            findings.expect_calls[rel] = expects
    return findings


def load_allow(path: Path = ALLOW_FILE) -> dict:
    with open(path, "rb") as f:
        allow = tomllib.load(f)
    unknown = set(allow) - {"long_functions", "unsafe_modules", "expect_calls"}
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {sorted(unknown)}")
    return allow


def violations(findings: Findings, allow: dict) -> list[str]:
    problems = []
    allowed_long = allow.get("long_functions", {})
    for key, lines in sorted(findings.long_functions.items()):
        limit = allowed_long.get(key)
        if limit is None:
            problems.append(
                f"{key} is {lines} lines (at most {MAX_FUNCTION_LINES}): split it by what each "
                "part owns"
            )
        elif lines > limit:
            problems.append(f"{key} grew to {lines} lines (allow-listed at {limit}): shrink it")
    for key, limit in sorted(allowed_long.items()):
        lines = findings.long_functions.get(key)
        if lines is None:
            problems.append(
                f"{key} is allow-listed as long but is now within {MAX_FUNCTION_LINES} lines "
                "(or gone): remove it from tidy_allow.toml"
            )
        elif lines < limit:
            problems.append(
                f"{key} shrank to {lines} lines (allow-listed at {limit}): lower its entry"
            )
    allowed_unsafe = set(allow.get("unsafe_modules", []))
    for module in sorted(findings.unsafe_modules - allowed_unsafe):
        problems.append(f"{module} uses `unsafe` but is not a listed unsafe module")
    for module in sorted(allowed_unsafe - findings.unsafe_modules):
        problems.append(f"{module} is listed as unsafe but has no `unsafe`: remove it")
    allowed_expect = allow.get("expect_calls", {})
    for module in sorted(set(findings.expect_calls) | set(allowed_expect)):
        have, limit = findings.expect_calls.get(module, 0), allowed_expect.get(module, 0)
        if have > limit:
            problems.append(
                f"{module} has {have} `.expect(` calls in production code (allowed {limit}): "
                "return a typed error instead"
            )
        elif have < limit:
            problems.append(
                f"{module} has {have} `.expect(` calls, allow-listed at {limit}: lower its entry"
            )
    return problems


def render_allow(findings: Findings) -> str:
    lines = [
        "# kvtier_dev.tidy's exceptions. This list may only shrink (see tidy.py).",
        "",
        "# Modules allowed `unsafe` (each opens with #![allow(unsafe_code)]).",
        "unsafe_modules = [",
    ]
    lines += [f'    "{m}",' for m in sorted(findings.unsafe_modules)]
    lines += ["]", "", f"# Functions over {MAX_FUNCTION_LINES} lines: their length today."]
    lines += ["[long_functions]"]
    lines += [f'"{k}" = {v}' for k, v in sorted(findings.long_functions.items())]
    lines += ["", "# `.expect(` calls in production code, per file.", "[expect_calls]"]
    lines += [f'"{k}" = {v}' for k, v in sorted(findings.expect_calls.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    findings = scan()
    if "--write" in argv:
        ALLOW_FILE.write_text(render_allow(findings))
        print(f"wrote {ALLOW_FILE}")
        return 0
    problems = violations(findings, load_allow())
    for p in problems:
        print(p)
    print(
        f"tidy: {len(findings.long_functions)} long functions, "
        f"{len(findings.unsafe_modules)} unsafe modules, "
        f"{sum(findings.expect_calls.values())} expect calls; {len(problems)} problem(s)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
