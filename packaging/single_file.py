"""Write the files for vendoring, single/jobq.py and single/jobq_web.py, from the jobq/ package.

    python packaging/single_file.py           write them
    python packaging/single_file.py --check   exit 1 if either differs from what it would write

The file is the package's modules in their import order (jobq/__init__.py's _MODULES), each
under a banner naming it, with the imports between modules removed (one namespace needs none)
and the third-party and standard-library imports gathered once at the top. Two modules defining
the same top-level name would shadow each other in one namespace: that is refused. The dashboard,
jobq_web.py, is a module of its own already (it finds a jobq.py beside it): it is copied as it
is, so that single/ holds everything a vendored copy needs. Nothing but this script writes
these files; CI runs --check.
"""

from __future__ import annotations

import ast
import difflib
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jobq"
TARGET = ROOT / "single" / "jobq.py"
WEB, WEB_TARGET = ROOT / "jobq_web.py", ROOT / "single" / "jobq_web.py"



class Refused(Exception):
    """The package cannot be written as one file as it stands."""


def _module_order(init: ast.Module) -> list[str]:
    for node in init.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "_MODULES":
            assert isinstance(node.value, ast.Tuple)
            return [elt.id for elt in node.value.elts if isinstance(elt, ast.Name)]
    raise Refused("jobq/__init__.py has no _MODULES tuple")


def _is_type_checking_block(node: ast.stmt) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
            and all(isinstance(s, ast.ImportFrom) and s.level > 0 for s in node.body) and not node.orelse)


def _defined(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


def _body(name: str, source: str, imports: dict[tuple[str, str | None], set[tuple[str, str | None]]],
          owners: dict[str, str]) -> str:
    """The module's text without its docstring and imports; its absolute imports go to `imports`."""
    tree = ast.parse(source)
    lines = source.splitlines()
    drop: set[int] = set()

    def drop_node(node: ast.AST) -> None:
        drop.update(range(node.lineno, node.end_lineno + 1))  # type: ignore[attr-defined,operator]

    body = tree.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        drop_node(body[0])
    for node in body:
        if isinstance(node, ast.Import):
            for a in node.names:
                imports.setdefault((a.name, None), set()).add((a.name, a.asname))
            drop_node(node)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if node.module != "__future__":
                    for a in node.names:
                        imports.setdefault(("from", node.module), set()).add((a.name, a.asname))
            drop_node(node)
        elif _is_type_checking_block(node):
            drop_node(node)
        for defined in _defined(node):
            if defined in owners and owners[defined] != name and defined != "__all__":
                raise Refused(f"{defined} is defined by both jobq/{owners[defined]}.py and jobq/{name}.py")
            owners[defined] = name
    # Imports between modules inside functions (where a module reaches one after it): the one
    # namespace has the names already.
    for inner in ast.walk(tree):
        if isinstance(inner, ast.ImportFrom) and inner.level > 0 and inner.lineno not in drop:
            drop_node(inner)
            if inner.end_lineno is not None and inner.end_lineno < len(lines) and not lines[inner.end_lineno].strip():
                drop.add(inner.end_lineno + 1)
    kept = [line for i, line in enumerate(lines, 1) if i not in drop]
    text = "\n".join(kept).strip("\n")
    return re.sub(r"\n{4,}", "\n\n\n", text)


def _import_lines(imports: dict[tuple[str, str | None], set[tuple[str, str | None]]]) -> str:
    def rank(module: str) -> tuple[int, str]:
        return (0 if module.split(".")[0] in sys.stdlib_module_names else 1, module)

    plain = sorted((k for k in imports if k[1] is None), key=lambda k: rank(k[0]))
    froms = sorted((k for k in imports if k[1] is not None), key=lambda k: rank(k[1] or ""))
    out = []
    for third_party in (0, 1):
        block = []
        for key in plain:
            if rank(key[0])[0] == third_party:
                block += [f"import {n}" + (f" as {a}" if a else "") for n, a in sorted(imports[key], key=str)]
        for key in froms:
            if rank(key[1] or "")[0] == third_party:
                names = ", ".join(n + (f" as {a}" if a else "") for n, a in sorted(imports[key], key=str))
                block.append(f"from {key[1]} import {names}")
        if block:
            out.append("\n".join(block))
    return "\n\n".join(out)


def render() -> str:
    """The single file's text, from the package as it is on disk."""
    init_source = (PACKAGE / "__init__.py").read_text()
    init = ast.parse(init_source)
    order = _module_order(init)
    docstring = ast.get_docstring(init, clean=False)
    all_node = next(n for n in init.body if isinstance(n, ast.Assign) and _defined(n) == ["__all__"])
    all_text = ast.get_source_segment(init_source, all_node) or ""
    imports: dict[tuple[str, str | None], set[tuple[str, str | None]]] = {}
    owners: dict[str, str] = {}
    parts = []
    for name in order:
        source = (PACKAGE / f"{name}.py").read_text()
        about = "\n".join(f"# {line}".rstrip() for line in (ast.get_docstring(ast.parse(source)) or "").splitlines())
        parts.append(f"# {'=' * 94}\n# jobq/{name}.py\n# {'=' * 94}\n{about}\n\n"
                     + _body(name, source, imports, owners))
    main = ast.parse((PACKAGE / "__main__.py").read_text())
    if not any(isinstance(n, ast.ImportFrom) and n.level > 0 and [a.name for a in n.names] == ["main"] for n in main.body):
        raise Refused("jobq/__main__.py is expected to import main from .cli and call it")
    used = set(re.findall(r"\b\w+\b", "\n".join(parts)))
    for key in list(imports):  # names only the dropped imports between modules needed
        imports[key] = {(n, a) for n, a in imports[key] if (a or n).split(".")[0] in used}
        if not imports[key]:
            del imports[key]
    head = (f'"""{docstring}"""\n\n'
            "# Generated by packaging/single_file.py from the jobq/ package: edit the package, not this file.\n\n"
            "from __future__ import annotations\n\n" + _import_lines(imports) + "\n\n" + all_text + "\n")
    tail = '\n\nif __name__ == "__main__":\n    sys.exit(main())\n'
    text = head + "\n\n" + "\n\n\n".join(parts) + "\n" + tail
    return re.sub(r"\n{4,}", "\n\n\n", text)


def main(argv: list[str]) -> int:
    try:
        text = render()
    except Refused as exc:
        print(f"single_file: {exc}", file=sys.stderr)
        return 2
    outputs = {TARGET: text, WEB_TARGET: WEB.read_text()}
    if "--check" in argv:
        stale = 0
        for path, wanted in outputs.items():
            current = path.read_text() if path.exists() else ""
            if current != wanted:
                stale += 1
                diff = difflib.unified_diff(current.splitlines(), wanted.splitlines(), "committed", "generated", lineterm="", n=1)
                print("\n".join(list(diff)[:40]), file=sys.stderr)
                print(f"{path.relative_to(ROOT)} is out of date: run python packaging/single_file.py", file=sys.stderr)
        if not stale:
            print(f"{', '.join(str(p.relative_to(ROOT)) for p in outputs)}: in sync with jobq/ and jobq_web.py")
        return 1 if stale else 0
    TARGET.parent.mkdir(exist_ok=True)
    for path, wanted in outputs.items():
        path.write_text(wanted)
    print(f"wrote {TARGET.relative_to(ROOT)} ({text.count(chr(10))} lines) and {WEB_TARGET.relative_to(ROOT)}")
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
