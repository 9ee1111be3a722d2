"""Layering that imports can break: the core and the API process's request path never import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


def modules_after_import(*names: str) -> set[str]:
    code = "import sys\n" + "".join(f"import {n}\n" for n in names) + "print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    "names",
    [
        # The scheduler, KV pool, prefix cache and policies: pure Python.
        ("tandem.core.scheduler", "tandem.core.kv_cache_manager", "tandem.core.prefix_cache", "tandem.core.policy"),
        # The speculation planner and its adaptive controller: pure Python too.
        ("tandem.spec.planner",),
        # The API process: HTTP, validation, tokenization, the engine client and its messages.
        (
            "tandem.entrypoints.openai.api_server",
            "tandem.engine.core_client",
            "tandem.engine.messages",
            "tandem.engine.processor",
        ),
    ],
)
def test_no_torch_on_the_request_path(names):
    loaded = modules_after_import(*names)
    assert "torch" not in loaded
    assert "tandem.engine.core" not in loaded  # the wire types are data, not the engine


def test_the_drafter_does_not_import_the_runner():
    """The runner uses the drafter, not the other way round: the drafter sees the runner through
    `DraftHost`, and both build batches with `tandem.worker.batch`."""
    assert "tandem.worker.model_runner" not in modules_after_import("tandem.worker.drafter")


def package_graph() -> dict[str, set[str]]:
    """Which of Tandem's packages (and top-level modules) import which, at module level (imports
    inside functions and TYPE_CHECKING blocks are deferred on purpose and not counted)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "tandem"

    def unit(module: str) -> str:
        parts = module.split(".")
        if len(parts) >= 2 and (root / parts[1]).is_dir():
            return parts[1]
        return module  # a top-level module: tandem.config, tandem.sampling_params, ...

    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        src = unit(module)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.startswith("tandem.") and unit(name) != src:
                    graph.setdefault(src, set()).add(unit(name))
    return graph


def test_packages_import_without_cycles():
    graph = package_graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])


def test_the_core_imports_only_plain_modules():
    """The scheduler's package reads the shared data modules, never another package."""
    assert {d for d in package_graph().get("core", set()) if not d.startswith("tandem.")} == set()


ENGINE_PROCESS = ("core", "core_proc", "load_report", "step_trace")
SHARED = ("messages",)


def test_the_engine_process_files_do_not_import_the_front_end():
    """docs/architecture.md maps engine/ by process side; the engine process's files reach only each
    other and the shared messages, so the map stays true (imports anywhere in the file count)."""
    import ast
    from pathlib import Path

    engine = Path(__file__).resolve().parents[2] / "tandem" / "engine"
    front = {p.stem for p in engine.glob("*.py")} - set(ENGINE_PROCESS) - set(SHARED) - {"__init__", "llm_engine"}
    assert {"core_client", "processor", "streams"} <= front
    offenders = []
    for name in ENGINE_PROCESS:
        for node in ast.walk(ast.parse((engine / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            else:
                continue
            offenders += [f"{name}.py imports {m}" for m in mods if m.removeprefix("tandem.engine.") in front]
    assert not offenders, offenders
