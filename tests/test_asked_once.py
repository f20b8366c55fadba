"""What a run's config fixes is answered in one place (``stem_megatron/run_plan.py``): where the STEM tables live
(``tables_on_host``, ``tables_on_device``; inside ``host_tables/``, the tables or their absence, ``build_tables``) and
a step's micro-batches (``micro_batches_per_step``). A second answer drifts from the first. Read from the code
(``ast``); nothing is imported."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stem_megatron"
# where the placement is the subject: the answer, and the placement a process is given (flag, argument) checked
PLACEMENT_SITES = {("run_plan.py", "tables_on_host"), ("inference/cli.py", "parse_args"),
                   ("inference/model.py", "__init__")}


class _Sites(ast.NodeVisitor):
    """(module, enclosing function) of each node ``match`` accepts."""

    def __init__(self, module: str, match):
        self.module, self.match, self.function, self.found = module, match, "<module>", []

    def visit_FunctionDef(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def generic_visit(self, node):
        if self.match(node):
            self.found.append((self.module, self.function))
        super().generic_visit(node)


def _sites(match, skip: str = "") -> list[tuple[str, str]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if not (skip and module.startswith(skip)):
            visitor = _Sites(module, match)
            visitor.visit(ast.parse(path.read_text()))
            found += visitor.found
    return found


def _named(node, name: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == name) or (isinstance(node, ast.Name) and node.id == name)


def _placement_test(node) -> bool:
    """``... placement == x`` or ``!=``: code that chooses by the placement's value."""
    return (isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
            and any(_named(side, "placement") for side in (node.left, *node.comparators)))


def _micro_batch_division(node) -> bool:
    """``global_batch_size // ...``: a step's micro-batches computed."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and _named(node.left, "global_batch_size")


def test_sites_are_found():
    tree = ast.parse("def f(cfg):\n    return cfg.host_tables.placement != 'host', t.global_batch_size // (m * dp)")
    for match in (_placement_test, _micro_batch_division):
        visitor = _Sites("m.py", match)
        visitor.visit(tree)
        assert visitor.found == [("m.py", "f")]


def test_placement_is_tested_where_it_is_the_subject():
    found = _sites(_placement_test, skip="host_tables/")
    assert len(found) <= 3 and set(found) <= PLACEMENT_SITES, (
        f"placement compared at {found}: ask stem_megatron.run_plan.tables_on_host / tables_on_device, or the "
        f"tables (host_tables.placement.build_tables), instead")


def test_micro_batches_per_step_is_computed_once():
    assert _sites(_micro_batch_division) == [("run_plan.py", "micro_batches_per_step")], (
        "a step's micro-batches computed again: call stem_megatron.run_plan.micro_batches_per_step")
