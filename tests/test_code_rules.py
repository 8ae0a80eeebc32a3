"""Two rules on the shape of the package's functions, read from the source with ``ast``
(``docs/contributing.md`` states them for contributors):

- **Length.** No function or method of ``src/flow_factory/`` is longer than 60 lines, counted
  from its ``def`` line to its last line (``end_lineno``; decorators not counted, nested
  functions counted inside their parent and on their own). A function that truly reads best
  as one may be longer when its docstring says why in a sentence beginning ``Long because``
  (for example "Long because it is one linear list of config checks, each independent.").
- **Parameters.** No function takes more than 8 parameters: positional-only, ordinary and
  keyword-only ones count; a method's leading ``self`` / ``cls`` and the ``*args`` /
  ``**kwargs`` catch-alls do not. Related parameters go into a small dataclass, as
  ``sampling.SamplingSettings`` does (a dataclass's generated ``__init__`` is not in the source,
  so dataclass constructors are exempt by construction).

The failure message lists every offender as ``path:line name (N lines / N params)``.
"""

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "flow_factory"
MAX_LINES = 60
MAX_PARAMS = 8
LONG_MARKER = "Long because"

def functions(tree: ast.AST, prefix: str = ""):
    """``(qualified name, node)`` for every function and method of ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")
        else:
            yield from functions(node, prefix)


def length(node) -> int:
    return node.end_lineno - node.lineno + 1


def parameters(node) -> int:
    args = node.args
    named = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
    if named and named[0] in ("self", "cls"):
        named = named[1:]
    return len(named)


@functools.cache
def offenders() -> dict[tuple[str, str], tuple[str, int, int]]:
    """``{(path, name): ("path:line name (N lines / N params)", N lines, N params)}`` for every function
    breaking a rule."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for name, node in functions(ast.parse(path.read_text(encoding="utf-8"))):
            lines, params = length(node), parameters(node)
            too_long = lines > MAX_LINES and LONG_MARKER not in (ast.get_docstring(node) or "")
            if too_long or params > MAX_PARAMS:
                found[(rel, name)] = (f"{rel}:{node.lineno} {name} ({lines} lines / {params} params)", lines, params)
    return found


def test_functions_are_short_and_take_few_parameters():
    bad = [line for line, _, _ in sorted(offenders().values())]
    assert not bad, (f"functions over {MAX_LINES} lines (without '{LONG_MARKER}' in the docstring) or over "
                     f"{MAX_PARAMS} parameters (docs/contributing.md):\n" + "\n".join(bad))


def test_the_rules_see_what_they_should():
    """The counting itself, on a made-up source."""
    source = '''
class A:
    def m(self, a, b, /, c, *args, d, e=1, **kw):
        def inner(x):
            return x
        return inner
    @classmethod
    def c(cls):
        """Long because it says so."""
'''
    found = {name: (length(node), parameters(node)) for name, node in functions(ast.parse(source))}
    assert found == {"A.m": (4, 5), "A.m.inner": (2, 1), "A.c": (2, 0)}  # decorators are not counted
