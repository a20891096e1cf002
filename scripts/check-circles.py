#!/usr/bin/env python3
"""Import circles between the files of each crate: fails when files import each other in a loop.

A file's imports are the `crate::`, `super::` and `self::` paths in its code (comments and the
inline `#[cfg(test)] mod tests` left out), each resolved to the module file it names. Files
that import each other, directly or through others, form a circle: a module that cannot be
read, tested or moved without the others. The circles known today are listed in KNOWN (each a
set of files); a new circle fails, and so does a known one that is gone (remove it from the
list, so that it cannot come back unseen).
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

KNOWN: list = [
    # None today. A circle that cannot be broken yet goes here as a set of files, with why.
]

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
PATH_START = re.compile(r"\b(crate|super|self)((?:\s*::\s*(?:" + IDENT + r"|\{))+)")


def code_of(text):
    """The file's code without comments, string and character literals, and the inline test
    module (a left-to-right scan, so that what opens a literal is never inside another)."""
    cut = re.search(r"^#\[cfg\(test\)\]\s*\n\s*mod tests\s*\{", text, re.M)
    if cut:
        text = text[: cut.start()]
    out, i, n = [], 0, len(text)
    ident = re.compile(r"[A-Za-z0-9_]")
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif c in "rb" and (i == 0 or not ident.match(text[i - 1])) and re.match(r"b?r#*\"", text[i:]):
            m = re.match(r"b?r(#*)\"", text[i:])
            end = text.find('"' + m.group(1), i + m.end())
            i = n if end < 0 else end + 1 + len(m.group(1))
            out.append('""')
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            i += 1
            out.append('""')
        elif c == "'" and re.match(r"'(?:\\[^']*|[^'\\\n])'", text[i:]):
            i += re.match(r"'(?:\\[^']*|[^'\\\n])'", text[i:]).end()
            out.append("' '")
        else:
            out.append(c)
            i += 1
    return "".join(out)


def group_paths(src, i):
    """The paths of a `{a, b::c, d::{e, f}}` group starting at src[i] == '{'; (paths, end)."""
    paths, cur, i = [], [], i + 1
    while i < len(src):
        c = src[i]
        if c == "{":
            inner, i = group_paths(src, i)
            paths += [cur + p for p in inner]
            cur = []
        elif c in ",}":
            if cur:
                paths.append(cur)
            cur = []
            if c == "}":
                return paths, i + 1
            i += 1
        else:
            m = re.compile(IDENT).match(src, i)
            if m:
                cur = cur + [m.group(0)]
                i = m.end()
            else:
                i += 1
    return paths, i


def paths_in(code):
    """Every `crate::…`/`super::…`/`self::…` path of `code`, as lists of segments."""
    out = []
    for m in PATH_START.finditer(code):
        head = [m.group(1)]
        rest = m.group(2)
        segs = re.findall(IDENT + r"|\{", rest)
        if segs and segs[-1] == "{":
            start = m.start(2) + rest.rfind("{")
            inner, _ = group_paths(code, start)
            out += [head + segs[:-1] + p for p in inner]
        else:
            out.append(head + segs)
    return out


def module_files(src_dir):
    """Module path (tuple of names, () for the crate root) -> file, for one crate's src/."""
    mods = {}
    for f in src_dir.rglob("*.rs"):
        rel = f.relative_to(src_dir).with_suffix("")
        parts = list(rel.parts)
        if parts in (["lib"], ["main"]):
            parts = []
        elif parts[-1] == "mod":
            parts = parts[:-1]
        mods.setdefault(tuple(parts), f)
    return mods


def graph_of(src_dir):
    """File -> the files it imports. A module's use of its own ancestors (`super::…` up to a
    parent that holds what its children share) is part of being a submodule, not an import."""
    mods = module_files(src_dir)
    files = {f: mod for mod, f in mods.items()}
    edges = {}
    for mod, f in mods.items():
        code = code_of(f.read_text(errors="replace"))
        # A child module declared here is named without a prefix (`mod x;` … `x::y`).
        children = re.findall(
            r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;", code, re.M
        )
        if children:
            code = re.sub(r"\b(" + "|".join(children) + r")(\s*::)", r"self::\1\2", code)
        targets = set()
        for p in paths_in(code):
            base = list(mod)
            if p[0] == "crate":
                base, p = [], p[1:]
            else:
                while p and p[0] in ("super", "self"):
                    if p[0] == "super":
                        base = base[:-1]
                    p = p[1:]
            # The longest prefix naming a module file.
            for n in range(len(p), -1, -1):
                target = mods.get(tuple(base + p[:n]))
                if target is not None:
                    break
            ancestor = target is not None and mod[: len(files[target])] == files[target]
            if target is not None and target != f and not ancestor:
                targets.add(target)
        edges[f] = targets
    return edges


def circles(edges):
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], 0
    for v0 in edges:
        if v0 in index:
            continue
        work = [(v0, iter(edges[v0]))]
        index[v0] = low[v0] = n
        n += 1
        stack.append(v0)
        on.add(v0)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(edges.get(w, ()))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def self_test():
    """The checker on a made-up crate: a loop through a child module and a grouped `use` is
    found; a child's use of its parent and paths in comments and strings are not imports."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d)
        (src / "a").mkdir()
        files = {
            "lib.rs": "mod a;\nmod b;\nmod c;\n",
            "a/mod.rs": "mod inner;\npub struct T;\nfn f() { inner::g(); }\n",
            "a/inner.rs": "use super::T;\nuse crate::{b::{self, B}};\npub fn g() {}\n",
            "b.rs": "pub struct B;\nfn h() { crate::a::T; }\n",
            "c.rs": '// crate::b::B\nconst S: &str = "crate::b::B";\nconst Q: char = \'"\';\n',
        }
        for name, text in files.items():
            (src / name).write_text(text)
        found = [{str(f.relative_to(src)) for f in c} for c in circles(graph_of(src))]
        assert found == [{"a/mod.rs", "a/inner.rs", "b.rs"}], found
        assert graph_of(src)[src / "c.rs"] == set()
    print("check-circles: self-test ok")


def main():
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return 0
    found = []
    for src in sorted(ROOT.glob("crates/*/src")) + [ROOT / "fuzz" / "fuzz_targets"]:
        if src.is_dir():
            for c in circles(graph_of(src)):
                found.append({str(f.relative_to(ROOT)) for f in c})
    fail = False
    for c in found:
        if c not in KNOWN:
            fail = True
            print("check-circles: files import each other in a loop:", file=sys.stderr)
            for f in sorted(c):
                print(f"  {f}", file=sys.stderr)
    for k in KNOWN:
        if k not in found:
            fail = True
            print(
                "check-circles: a known circle is gone (or changed); update KNOWN in "
                f"{Path(__file__).relative_to(ROOT)}: {sorted(k)}",
                file=sys.stderr,
            )
    if not fail:
        print(f"check-circles: ok ({len(KNOWN)} known circles, no new one)")
    return 1 if fail else 0


if __name__ == "__main__":
    sys.exit(main())
