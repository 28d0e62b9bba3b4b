"""``make mutate``: a small mutation run over the pure modules, against their unit tests.

Each mutant changes one thing in one module (a comparison, a boolean operator, a
``not``, an integer, a condition), the module's tests run against it, and a mutant
that no test fails "survives": a promise the tests do not hold.  It writes the
mutated module in place (the venv links the source), so run it alone on a
checkout, never beside another test run; the file is restored after each mutant.

    python tests/mutate.py [--max N] [--module NAME ...]

Prints each survivor (file:line: the change) and a score per module and in all.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = REPO / ".venv" / "bin" / "python"

# module -> the unit tests that hold it
TARGETS = {
    "agent/core/reference.py": ["tests/unit/core/test_reference.py"],
    "agent/step/binds.py": ["tests/unit/step/test_binds.py", "tests/unit/step/test_userpath.py"],
    "agent/core/hostlist.py": ["tests/unit/step/test_taskenv.py"],
    "agent/step/taskenv.py": ["tests/unit/step/test_taskenv.py"],
    "agent/cache/evict.py": ["tests/unit/cache/test_evict.py"],
    "agent/core/config.py": [
        "tests/unit/core/test_config.py",
        "tests/unit/core/test_config_compile.py",
    ],
}

_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}


@dataclass(frozen=True)
class Mutant:
    line: int
    what: str
    source: str


class _Mutator(ast.NodeTransformer):
    """Makes the ``target``-th possible change; counts them all."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.seen = 0
        self.done: tuple[int, str] | None = None

    def _hit(self, node: ast.AST, what: str) -> bool:
        self.seen += 1
        if self.seen - 1 == self.target:
            self.done = (getattr(node, "lineno", 0), what)
            return True
        return False

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        op = type(node.ops[0])
        if op in _SWAP and self._hit(node, f"{op.__name__} -> {_SWAP[op].__name__}"):
            node.ops[0] = _SWAP[op]()
        return node

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.AST:
        self.generic_visit(node)
        other = ast.Or if isinstance(node.op, ast.And) else ast.And
        if self._hit(node, f"{type(node.op).__name__} -> {other.__name__}"):
            node.op = other()
        return node

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.op, ast.Not) and self._hit(node, "not removed"):
            return node.operand
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        if (
            isinstance(node.value, int)
            and not isinstance(node.value, bool)
            and self._hit(node, f"{node.value} -> {node.value + 1}")
        ):
            return ast.copy_location(ast.Constant(node.value + 1), node)
        return node

    def visit_If(self, node: ast.If) -> ast.AST:
        self.generic_visit(node)
        if self._hit(node, "if condition negated"):
            node.test = ast.UnaryOp(op=ast.Not(), operand=node.test)
        return node

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        # Docstrings and bare strings are not code: leave their constants alone.
        if isinstance(node.value, ast.Constant):
            return node
        return self.generic_visit(node)


def mutants(path: Path) -> Iterator[Mutant]:
    text = path.read_text()
    i = 0
    while True:
        m = _Mutator(i)
        tree = m.visit(ast.parse(text))
        if m.done is None:
            return
        yield Mutant(m.done[0], m.done[1], ast.unparse(ast.fix_missing_locations(tree)))
        i += 1


def killed(tests: list[str], timeout: float) -> bool:
    try:
        r = subprocess.run(
            [str(PY), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
            cwd=REPO,
            capture_output=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return True  # a mutant that hangs the tests is caught, if expensively
    return r.returncode != 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max", type=int, default=60, help="mutants per module at most (spread)")
    p.add_argument("--module", action="append", default=[], help="only these (e.g. reference)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per test run")
    args = p.parse_args()
    total = dead = 0
    for rel, tests in TARGETS.items():
        if args.module and not any(m in rel for m in args.module):
            continue
        path = REPO / rel
        original = path.read_text()
        if killed(tests, args.timeout):
            print(f"{rel}: its tests fail unmutated; fix that first", file=sys.stderr)
            return 1
        every = list(mutants(path))
        step = max(1, len(every) // args.max)
        chosen = every[::step][: args.max]
        started = time.monotonic()
        survivors = []
        try:
            for m in chosen:
                path.write_text(m.source)
                if not killed(tests, args.timeout):
                    survivors.append(m)
        finally:
            path.write_text(original)
        n, k = len(chosen), len(chosen) - len(survivors)
        total, dead = total + n, dead + k
        took = time.monotonic() - started
        print(f"{rel}: {k}/{n} killed ({len(every)} possible; {took:.0f} s)")
        for m in survivors:
            print(f"  survived {rel}:{m.line}: {m.what}")
    if total:
        print(f"score: {dead}/{total} = {100 * dead / total:.0f}% of mutants killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
