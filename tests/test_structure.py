"""The house's size limits and the server's seam with the runner, read from the source.

- no product file over 650 lines (the generated gRPC stubs aside);
- no constructor (``__init__``, ``__post_init__``) over 60 lines, docstring included;
- server/ never asks what type a runner is (``isinstance``) and reads no runner attribute
  under a ``type: ignore``: what it needs is on ``model_runner.base.Runner``;
- the server's packages read the environment in one place (``model_runner.environment``),
  besides the cluster's Ray plumbing;
- one step ahead has one owner per side: in model_runner/ at most two files read the
  placeholder token (``model_runner.future`` and the fake runner), no runner sets a field of
  its model from outside, and in scheduler/ only ``scheduler.entry`` counts what is in
  flight (``num_inflight_tokens`` / ``num_placeholders``);
- LoRA's targets are written once (``model_runner.lora.targets``; the kernels' copy is checked
  at load), the forward of every path takes no adapter argument, and the model asks nothing
  about adapters beyond what each step's updates answer.

(No import circle: tests/test_import_cycles.py.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = tuple(
    sorted(d.name for d in REPO.iterdir() if (d / "__init__.py").is_file() and d.name != "tests")
)
MAX_FILE_LINES = 650
MAX_CONSTRUCTOR_LINES = 60
CONSTRUCTORS = ("__init__", "__post_init__")
# The packages of the server (loadtest/ and benchmarks/ are clients and tools), and the files
# that may read the environment there: the one reader, and the cluster's Ray plumbing (Ray
# hands settings to the processes it starts through the environment).
SERVER_PACKAGES = ("cache_manager", "cluster", "kv_store", "metrics", "model_runner",
                   "scheduler", "server")  # fmt: skip
ENV_READERS = ("model_runner/environment.py", "cluster/app.py", "cluster/cli.py", "cluster/edge.py")
_ENV_READ = re.compile(r"\bos\.(environ|getenv)\b|\bgetenv\(")


def _product_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).parts
            if "rpc" not in parts and "_build" not in parts:  # generated
                files.append(path)
    return files


def _long_constructors(source: str, limit: int) -> list[tuple[str, int]]:
    """(qualified name, lines) of each constructor in ``source`` over ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and (
                item.name in CONSTRUCTORS
            ):
                assert item.end_lineno is not None
                lines = item.end_lineno - item.lineno + 1
                if lines > limit:
                    found.append((f"{node.name}.{item.name}", lines))
    return found


def _runner_type_questions(source: str) -> list[str]:
    """``isinstance`` calls on a runner (its argument names one, or the class is a
    ``...Runner``), and runner attributes read under ``type: ignore``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            continue
        subject, classes = (ast.unparse(a) for a in node.args)
        if "runner" in subject.lower() or re.search(r"Runner\b", classes):
            found.append(ast.unparse(node))
    for line in source.splitlines():
        if re.search(r"runner\w*\.\w+.*#\s*type:\s*ignore", line, re.IGNORECASE):
            found.append(line.strip())
    return found


# What reads the placeholder token: the scheduler's id, its test, and its encoded form.
PLACEHOLDER_NAMES = frozenset({"PLACEHOLDER_TOKEN_ID", "has_placeholder", "encode"})
MAX_PLACEHOLDER_FILES = 2
IN_FLIGHT_COUNTS = frozenset({"num_inflight_tokens", "num_placeholders"})


def _names_read(source: str, names: frozenset[str]) -> list[int]:
    """Lines where ``source``'s code (not its docstrings) names one of ``names``: a name,
    an attribute, or an imported name (``encode`` only as ``FutureTokens.encode``)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in names:
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in names:
            owner = ast.unparse(node.value)
            if node.attr != "encode" or owner == "FutureTokens":
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(a.name in names for a in node.names):
            lines.append(node.lineno)
    return lines


def _fields_set_on_a_model(source: str) -> list[str]:
    """Assignments to an attribute of something's ``model`` (``self.model.x = ...``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            owner = target.value if isinstance(target, ast.Attribute) else None
            if isinstance(owner, ast.Attribute) and owner.attr == "model":
                found.append(ast.unparse(target))
    return found


def test_no_product_file_is_over_the_limit() -> None:
    files = _product_files()
    long = {
        str(p.relative_to(REPO)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"over {MAX_FILE_LINES} lines: {long}"
    assert len(files) > 100  # the walk found the packages


def test_no_constructor_is_over_the_limit() -> None:
    long = {
        f"{p.relative_to(REPO)}:{name}": n
        for p in _product_files()
        for name, n in _long_constructors(p.read_text(), MAX_CONSTRUCTOR_LINES)
    }
    assert not long, f"constructors over {MAX_CONSTRUCTOR_LINES} lines: {long}"


def test_the_server_never_asks_what_a_runner_is() -> None:
    """No ``isinstance`` on a runner in server/, no runner attribute under ``type: ignore``:
    every runner has ``submit``, ``can_run_ahead`` and ``adapters`` (``Runner``)."""
    questions = {
        str(p.relative_to(REPO)): q
        for p in sorted((REPO / "server").rglob("*.py"))
        if "rpc" not in p.parts and (q := _runner_type_questions(p.read_text()))
    }
    assert not questions, questions


def test_the_environment_is_read_in_one_place() -> None:
    """STYLE rule 8: ``model_runner.environment`` reads it (the server's settings and the
    process switches: the kernels', the model's), not each module for itself."""
    assert set(SERVER_PACKAGES) <= set(PACKAGES)
    readers = {
        str(p.relative_to(REPO)): hits
        for package in SERVER_PACKAGES
        for p in sorted((REPO / package).rglob("*.py"))
        if "_build" not in p.parts
        and (hits := [ln.strip() for ln in p.read_text().splitlines() if _ENV_READ.search(ln)])
    }
    assert "model_runner/environment.py" in readers  # the walk sees what it looks for
    stray = {path: hits for path, hits in readers.items() if path not in ENV_READERS}
    assert not stray, f"read the environment through model_runner.environment: {stray}"


def test_the_placeholder_token_has_one_owner_in_the_runners() -> None:
    """At most two files of model_runner/ read the placeholder token (``future`` owns it;
    the fake runner reads its own), and none sets a field of a model from outside (the
    future tokens are a constructor argument)."""
    runner_files = sorted((REPO / "model_runner").rglob("*.py"))
    readers = {
        str(p.relative_to(REPO)): lines
        for p in runner_files
        if (lines := _names_read(p.read_text(), PLACEHOLDER_NAMES))
    }
    assert "model_runner/future.py" in readers  # the walk sees the owner
    assert len(readers) <= MAX_PLACEHOLDER_FILES, readers
    set_outside = {
        str(p.relative_to(REPO)): found
        for p in runner_files
        if (found := _fields_set_on_a_model(p.read_text()))
    }
    assert not set_outside, set_outside


def test_only_the_entry_counts_what_is_in_flight() -> None:
    """scheduler/ does its in-flight arithmetic in ``scheduler.entry`` alone: the scheduler
    and the result applier ask the entry (``next_pos``, ``slots_for``, ``take_applied``)."""
    counters = {
        str(p.relative_to(REPO)): lines
        for p in sorted((REPO / "scheduler").rglob("*.py"))
        if p.name != "entry.py" and (lines := _names_read(p.read_text(), IN_FLIGHT_COUNTS))
    }
    assert _names_read((REPO / "scheduler" / "entry.py").read_text(), IN_FLIGHT_COUNTS)
    assert not counters, counters


# Where LoRA's targets could be written again: the LoRA package, the model and its paths,
# the runner, and the benchmark's adapter maker. Only ``lora/targets.py`` names them.
LORA_FACT_FILES = ("model_runner/lora", "model_runner/model.py", "model_runner/paths.py",
                   "model_runner/fused_step.py", "model_runner/runner.py",
                   "benchmarks/tools/make_random_lora.py")  # fmt: skip
_TARGET_FACT = re.compile(
    r'"(?:(?:q|k|v|o|gate|up|down|qkv|gate_up)_proj|attn_(?:q|k|v|output)|ffn_(?:gate|up|down))"'
    r'|\("q", "k"|"gate", "up"\)'
)
# The forwards of the paths, the model and the kernels' step, and what they may take.
FORWARD_FILES = ("model_runner/model.py", "model_runner/paths.py", "model_runner/fused_step.py")
FORWARD_ARGS = frozenset({"self", "step", "rows", "batch", "pool"})


def _target_facts(source: str) -> list[str]:
    return [m.group(0) for m in _TARGET_FACT.finditer(source)]


def _forward_args(source: str) -> dict[str, list[str]]:
    """Each ``forward``'s arguments, by its class."""
    found = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "forward":
                    args = item.args
                    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                    found[node.name] = names
    return found


def _adapter_presence_tests(source: str) -> list[str]:
    """``if``s that ask whether a step has adapters (``lora`` or ``adapters`` tested for
    truth or against None, alone or in ``and`` / ``or`` / ``not``)."""

    def names_adapters(node: ast.expr) -> bool:
        name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
        return name in ("lora", "adapters")

    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.If | ast.IfExp):
            continue
        parts = [node.test]
        while parts:
            part = parts.pop()
            if isinstance(part, ast.BoolOp):
                parts.extend(part.values)
            elif isinstance(part, ast.UnaryOp) and isinstance(part.op, ast.Not):
                parts.append(part.operand)
            elif names_adapters(part.left if isinstance(part, ast.Compare) else part):
                found.append(ast.unparse(node.test))
                break
    return found


def test_the_lora_targets_are_written_once() -> None:
    """``model_runner.lora.targets`` is the one table of what an adapter updates (its
    modules' names, each projection's targets); the kernels hold no hand-written spans, only
    the table in lora.h that the load-time check compares (``kv_lora_target``)."""
    files = [
        f
        for name in LORA_FACT_FILES
        for f in ((REPO / name).rglob("*.py") if (REPO / name).is_dir() else [REPO / name])
    ]
    facts = {
        str(p.relative_to(REPO)): found
        for p in files
        if p.name != "targets.py" and (found := _target_facts(p.read_text()))
    }
    assert _target_facts((REPO / "model_runner/lora/targets.py").read_text())
    assert not facts, f"name LoRA's targets through model_runner.lora.targets: {facts}"
    kernels = REPO / "model_runner/kernels"
    sources = {p.name: p.read_text() for p in (*kernels.glob("*.h"), *kernels.glob("*.cpp"))}
    tables = [name for name, text in sources.items() if "LORA_TARGETS[LORA_NUM_TARGETS] =" in text]
    assert tables == ["lora.h"]
    spans = {name: re.findall(r"\bLT_\w+|LoraSpan\{", text) for name, text in sources.items()}
    assert {name: hits for name, hits in spans.items() if hits} == {"lora.h": ["LoraSpan{"]}


def test_no_forward_takes_an_adapter_argument() -> None:
    """The model, every path and the kernels' step run a step's adapters from the step
    (``StepRows.lora``, ``ForwardBatch.adapters``): no ``forward`` takes them, and the
    model never asks whether a step has any."""
    forwards = {
        f"{name}.{cls}": args
        for name in FORWARD_FILES
        for cls, args in _forward_args((REPO / name).read_text()).items()
    }
    assert {"model.py.LlamaModel", "paths.py.EagerPath", "fused_step.py.FusedStep"} <= {
        k.removeprefix("model_runner/") for k in forwards
    }
    extra = {k: a for k, a in forwards.items() if set(a) - FORWARD_ARGS}
    assert not extra, extra
    assert not _adapter_presence_tests((REPO / "model_runner/model.py").read_text())


def test_the_checks_see_what_they_look_for() -> None:
    """The walks find the shapes they forbid (the server's old lines among them)."""
    ahead = "ok = isinstance(runner, AheadRunner) and runner.can_run_ahead\n"
    ignored = "adapters = runner.lora  # type: ignore[attr-defined]\n"
    assert _runner_type_questions(ahead) == ["isinstance(runner, AheadRunner)"]
    assert _runner_type_questions(ignored) == [ignored.strip()]
    assert _runner_type_questions("isinstance(self._runner, object)\n")
    assert _runner_type_questions("isinstance(x, FakeRunner)\n")
    assert not _runner_type_questions("isinstance(router, Router)\n")
    body = "\n".join(f"        self.a{i} = {i}" for i in range(61))
    source = f"class C:\n    def __init__(self) -> None:\n{body}\n"
    assert _long_constructors(source, MAX_CONSTRUCTOR_LINES) == [("C.__init__", 62)]
    assert _long_constructors(source, 62) == []
    old_step = (
        '"""PLACEHOLDER_TOKEN_ID in a docstring is no read."""\n'
        "from scheduler.output import PLACEHOLDER_TOKEN_ID\n"
        "if seq.has_placeholder:\n"
        "    ids = [FutureTokens.encode(j), codec.encode(j)]\n"
    )
    assert _names_read(old_step, PLACEHOLDER_NAMES) == [2, 3, 4]
    assert _names_read("entry.num_inflight_tokens -= 1\n", IN_FLIGHT_COUNTS) == [1]
    old_runner = "self.future = self.model.future = FutureTokens(n, device)\n"
    assert _fields_set_on_a_model(old_runner) == ["self.model.future"]
    assert not _fields_set_on_a_model("self.model = LlamaModel(future=f)\nmodel.x = 1\n")
    old_layout = 'TARGETS = ("q", "k", "v", "o", "gate", "up", "down")\nHF = {"q": "q_proj"}\n'
    assert _target_facts(old_layout) == ['("q", "k"', '"q_proj"']
    assert _target_facts('FUSED = {"gate_up_proj": 1, "attn_output": 2}') == [
        '"gate_up_proj"',
        '"attn_output"',
    ]
    old_model = (
        "class LlamaModel:\n"
        "    def forward(self, batch, pool, lora=None):\n"
        "        ops = self._fusion_ops(batch, pool) if lora is None else None\n"
        "        if lora is not None and lora.touches(i, spans):\n"
        "            pass\n"
        "        if adapters:\n"
        "            pass\n"
    )
    assert _forward_args(old_model) == {"LlamaModel": ["self", "batch", "pool", "lora"]}
    assert sorted(_adapter_presence_tests(old_model)) == [
        "adapters",
        "lora is None",
        "lora is not None and lora.touches(i, spans)",
    ]
    assert not _adapter_presence_tests(
        "if self.act is silu and not adapters.touches(i, p):\n    pass\n"
    )
