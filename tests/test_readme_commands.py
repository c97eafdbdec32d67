"""Every command that README.md, infra/README.md and the pages under docs/ show works on this checkout, as the page
writes it (a command moved from one page to another is checked where it lands; a new page is read as it is added).

Which text is a command:
- every line of a ```bash (or sh, shell) block: a trailing `\\` joins the next line, `# ...` outside quotes is
  a comment, blank lines are skipped; what is left of a line is one command (`a && b` included);
- elsewhere (prose, yaml and plain-text blocks): an inline code span, and in a plain-text block the text after a
  `label:` of an output line, whose first word (after any `VAR=value`) is a program in PROGRAMS and which has at
  least one more word: `flywheel serve` is a command, `flywheel.gate` and a lone `flywheel` are names.

Each command is classified by the first rule in RULES it matches, and a command no rule matches fails the test,
so a new README command is made runnable here or listed in NOT_RUN with the reason:
- flywheel: argv as bash builds it (`$(...)` evaluated, `<placeholders>` filled in) must parse with the CLI's own
  parser: a code block line as a complete command, an inline span (prose naming a command and the option it talks
  about) with its required arguments allowed missing. RUN_HERE ones run for real in this checkout; `flywheel run`,
  `compare` and `status` of the demo run for real on the small test pipeline (slow).
- make: `make -n TARGET` works and its recipe calls what MAKE_CALLS says.
- benchmark: the script is run with `--quick` (the same code path on tiny sizes) and prints its figures as one
  JSON line last (slow); every benchmarks/*.py is run so, except the ones in NOT_RUN_HERE.
- help: a command of a tool the project depends on (Prefect, MLflow, DVC, mkdocs): `TOOL SUBCOMMAND --help` works and
  names every option the README passes.
- server: the tests' OpenAI-compatible server is started, answers, and is stopped.
- not run: NOT_RUN says why.
For every command, each path under infra/, benchmarks/, tests/, examples/ or .ci/ it names must exist.

The commands run with the project's packages importable only as an install makes them (PYTHONPATH is a folder
holding just the packages pyproject.toml installs), from the project root, as a new user types them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
READMES = [REPO / "README.md", REPO / "infra" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BIN = Path(sys.executable).parent

PROGRAMS = {"flywheel", "make", "python", "bash", "dvc", "git", "prefect", "mlflow", "docker", "kubectl", "vllm",
            "accelerate", "rm", "export", "pip", "mkdocs"}

RULES = [
    (r"flywheel dvc-yaml( |$)", "generate"),
    (r"flywheel ", "flywheel"),
    (r"make ", "make"),
    (r"python benchmarks/\w+\.py", "benchmark"),
    (r"python tests/openai_server\.py", "server"),
    (r"(prefect|mlflow|dvc|mkdocs) ", "help"),
]
NOT_RUN = {
    r"docker ": "Docker is not available here; tests/test_servers.py parses infra/docker-compose.yml instead",
    r"vllm serve ": "needs a GPU and a model download",
    r"accelerate launch( |$)": "multi-GPU SFT; tests/test_sft_launch.py runs the launcher on CPU",
    r"export ": "points the shell at shared servers, which are not here; tests/test_servers.py sets the same "
                "variables for its loopback servers",
    r"git (add|commit|clone|worktree)( |$)": "changes or clones the user's own repository",
    r"rm ": "deletes a file of the user's project state",
    r"pip install ": "changes the user's environment; `make` installs the same pins (the dev extra holds every "
                     "optional one that runs here)",
    r"bash \.ci/run": "CI itself: builds a venv and runs this whole suite (it would run this test again)",
}
# Run for real in this checkout (cheap; MLflow and Prefect state in temporary folders).
RUN_HERE = ["flywheel check", "flywheel status demo"]
# What each make target's recipe must call.
MAKE_CALLS = {"demo": ["flywheel run demo"], "test": ["pytest -q -n auto --maxschedchunk 1"],
              "test-fast": ['pytest -q -n auto --maxschedchunk 1 -m "not slow"'],
              "bench": ["benchmarks/"], "smol": ["flywheel run smol"], "stack": ["flywheel stack up"],
              # only installs (nothing to print once the venv has the extra): that `make -n` works is the check
              "smol-setup": [], "qwen-setup": []}
# Subcommands whose --help the help rule reads; a tool command naming another one is unclassified.
TOOL_SUBCOMMANDS = ["prefect server start", "prefect worker start", "prefect work-pool create", "mlflow ui",
                    "mlflow server", "dvc remote add", "dvc remote modify", "dvc pull", "dvc push", "dvc repro",
                    "dvc status", "dvc commit", "dvc checkout", "mlflow models serve", "mkdocs serve", "mkdocs build"]
# Benchmarks the tests do not run, with the reason; `make bench` need not run them either.
# Benchmarks whose --quick form cannot run here either (none today: gpu_check.py --quick runs its path on the CPU).
NOT_RUN_HERE: dict[str, str] = {
    "bigger_student.py": "the bigger student is opt-in (`make qwen-setup`, a 491 MB download CI does not make); "
                         "tests/test_split_gguf.py joins split GGUF files and (slow, where installed) loads it",
    "stack.py": "tests/test_stack.py starts the same stack and does the same runs and faults (its --quick form "
                "would add 90 s to a suite at its 15-minute budget)",
    "stack_folders.py": "a stack, two workers and three runs of the pipeline: 7-9 minutes even --quick, and root for "
                        "its mount namespace; tests/test_stage_folders.py runs stage jobs in folders of their own "
                        "in the suite"}
# Benchmarks whose full form needs a GPU: `make bench` (CPU) leaves them out; their --quick form runs here.
GPU_ONLY = {"gpu_check.py": "its full form exits 1 without a CUDA GPU"}
# Benchmarks whose full form reads public data cloned from GitHub (no clone at run time here): `make bench` leaves
# them out; their --quick form reads the slices committed in tests/data/ and runs here.
NEEDS_A_CLONE = {"real_logs.py": "the public logs (docs/real-logs.md says which and where)"}
# The keys of each benchmark's JSON line that the README's figures are read from.
FIGURES = {
    "collect.py": {"records", "megabytes", "json_loads_records_per_s", "collect_stage_records_per_s",
                   "collect_stage_s", "ratio_json_loads_to_stage", "peak_rss_mb", "incremental_no_new_s",
                   "incremental_1pct_new_s", "incremental_1pct_identical_to_full", "workers",
                   "collect_stage_cpu_s", "one_process_stage_s", "ratio_json_loads_to_one_process",
                   "worker_peak_rss_mb"},
    "synthesis.py": {"concurrency", "samples_per_s_concurrent", "samples_per_s_sequential", "ratio", "ideal_ratio",
                     "fraction_of_ideal"},
    "envs.py": {"harness_episodes_per_s", "bare_episodes_per_s", "ratio"},
    "constrained.py": {"library", "tiny_compile_ms", "tiny_masked_us_per_token", "tiny_free_us_per_token",
                       "smol_compile_ms", "smol_masked_us_per_token", "smol_free_us_per_token"},
    "replay.py": {"traces", "recorded_calls", "answered", "episodes_per_s", "recorded", "null", "id_only"},
    "sft.py": {"steps", "batch_size", "stage_tokens_per_s", "bare_trl_tokens_per_s", "ratio"},
    "rl_async.py": {"sync_wall_s", "async_wall_s", "sync_generate_s", "sync_train_s", "sync_learner_idle_fraction",
                    "async_learner_idle_fraction", "speedup", "ideal_speedup", "fraction_of_ideal"},
    "demo_student.py": {"base_pass_rate", "sft_pass_rate", "sft_runtime_s", "sft_tokens_per_s"},
    "rl_gain.py": {"sft_success", "rl_success", "lower_bounds", "lift_shown"},
    "gpu_check.py": {"mode", "sft_full", "sft_lora", "sft_qlora", "rl", "evaluate", "wall_s"},
    "smol.py": {"steps", "batch_size", "precision", "stage_tokens_per_s", "bare_torch_tokens_per_s", "sft_ratio",
                "padding_share", "opening_read_once_share", "bf16_speedup", "bf16_max_loss_diff",
                "one_thread_tokens_per_s", "load_first_s", "load_cached_s", "harness_tokens_per_s",
                "bare_generate_tokens_per_s", "generate_ratio"},
    "serve.py": {"requests", "server_requests_per_s", "server_mean_latency_s", "generate_requests_per_s",
                 "generate_mean_latency_s", "ratio", "clients", "concurrent_requests_per_s", "concurrent_p50_s",
                 "concurrent_p95_s", "generate_p50_s", "generate_p95_s", "concurrent_ratio", "batched_ratio",
                 "unbatched_requests_per_s", "batching_gain", "generate_calls", "mean_batch_rows"},
    "served_calls.py": {"requests", "constrained", "choices", "tool_calls", "markup_in_content", "malformed_finish",
                        "invalid_calls", "required_requests", "required_met", "required_refused", "none_with_calls",
                        "resampled"},
    "real_logs.py": {"records", "tasks", "contradicted", "recorded", "null", "id-only", "drop-last-write",
                     "wrong-argument"},
    "stack.py": {"stack_up_s", "cached_run_embedded_s", "cached_run_stack_s", "ratio", "schedule_start_delay_s",
                 "crash_marked_s"},
    "stack_folders.py": {"stack_up_s", "stages_on", "files_identical", "two_folder_run_s", "one_folder_run_s", "ratio",
                         "cached_rerun_s", "cached_rerun_ran"},
    "opd.py": {"sft_success", "rl_success", "opd_success", "opd_minus_sft_lower", "opd_lift_shown", "rl_lift_shown",
               "opd_minus_rl", "opd_episodes", "rl_episodes", "opd_generated_tokens", "rl_generated_tokens",
               "opd_trained_tokens", "rl_trained_tokens", "opd_wall_s", "rl_wall_s", "opd_to_rl_generated_tokens",
               "opd_to_rl_trained_tokens", "opd_to_rl_wall"},
    "generation.py": {"kept_tokens_per_s", "reread_tokens_per_s", "generate_tokens_per_s", "kept_ratio", "loop_ratio",
                      "same_tokens", "same_rows_share", "generate_same_share", "kept_read_share", "row_steps_share"},
    "peer_rl.py": {"trl_version", "project_episodes_per_s", "trl_episodes_per_s", "ratio",
                   "project_generated_tokens_per_s", "trl_generated_tokens_per_s", "project_wall_s", "trl_wall_s",
                   "project_peak_rss_mb", "trl_peak_rss_mb", "project_heldout_pass_rate", "trl_heldout_pass_rate",
                   "sft_heldout_pass_rate", "heldout_difference", "heldout_difference_interval", "steady_ratio",
                   "project_generate_s", "project_learn_s", "project_wait_s", "trl_generate_s", "trl_learn_s",
                   "project_actors", "max_error_turns", "max_episode_tokens"},
}


def _strip_comment(line: str) -> str:
    """The line without a `# comment` that starts outside quotes after whitespace."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def _is_command(text: str) -> bool:
    words = text.split()
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if len(words) < 2:
        return False
    first = words[0].removeprefix(".venv/bin/")
    return first in PROGRAMS


def _normalise(text: str) -> str:
    """One line, single spaces, VAR=value prefixes and the `.venv/bin/` of a program dropped."""
    text = " ".join(text.split())
    text = re.sub(r"^([A-Z_]+=\S*\s+)+", "", text)
    return text.removeprefix(".venv/bin/")


def readme_commands() -> list[tuple[str, str, bool]]:
    """(readme file, command, complete) for every command of the READMEs; complete: from a shell block."""
    found = []
    for readme in READMES:
        text = readme.read_text()
        name = readme.relative_to(REPO).as_posix()
        prose = text
        for match in re.finditer(r"^( *)```(\w*)\n(.*?)^\1```", text, flags=re.M | re.S):
            lang, body = match.group(2), match.group(3)
            prose = prose.replace(match.group(0), "\n")
            if lang in ("bash", "sh", "shell"):
                joined = re.sub(r"\\\n\s*", " ", body)
                for line in joined.splitlines():
                    line = _strip_comment(line).strip()
                    if line:
                        found.append((name, _normalise(line), True))
                continue
            spans = re.findall(r"`([^`]+)`", body)
            if not lang:  # plain output: the text after a "label:" on a line
                spans += [m.group(1) for m in re.finditer(r"^[ \t]*[\w ]+:[ \t]+(.+)$", body, flags=re.M)]
            found += [(name, _normalise(s), False) for s in spans if _is_command(s)]
        found += [(name, _normalise(s), False) for s in re.findall(r"`([^`]+)`", prose) if _is_command(s)]
    return found


def classify(command: str) -> str | None:
    """The rule's kind, "not run", or None when no rule says what to do with the command."""
    for pattern, kind in RULES:
        if re.match(pattern, command):
            if kind == "help" and not any(command.startswith(s + " ") or command == s for s in TOOL_SUBCOMMANDS):
                return None
            return kind
    return "not run" if any(re.match(pattern, command) for pattern in NOT_RUN) else None


COMMANDS = readme_commands()


@pytest.fixture(scope="session")  # built once a worker: this module's tests are handed out one by one
def installed_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a user's shell: the packages pyproject.toml installs importable, nothing else added."""
    site = tmp_path_factory.mktemp("site")
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in include["include"]:
        (site / package.rstrip("*")).symlink_to(REPO / package.rstrip("*"))
    return os.environ | {"PYTHONPATH": str(site), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def _shell(command: str, env: dict, cwd: Path = REPO, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a README command as a user's shell would, with `.venv/bin` programs taken from this venv."""
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _fill(command: str, values: list[str] | None = None) -> str:
    """`<placeholders>` replaced by the given values in order, or by a word, so bash does not read a redirect."""
    values = list(values or [])
    return re.sub(r"<[^>]+>", lambda m: values.pop(0) if values else "PLACEHOLDER", command)


def test_every_readme_command_is_classified():
    assert len(COMMANDS) > 30, "the README parser found too few commands"
    assert any(name.startswith("docs/") for name, _, _ in COMMANDS), "no command found in the pages under docs/"
    unknown = [f"{name}: {command}" for name, command, _ in COMMANDS if classify(command) is None]
    assert not unknown, ("README commands this test does not know how to check (make them runnable here, or add "
                         "them to NOT_RUN with the reason):\n" + "\n".join(unknown))


def test_paths_named_by_readme_commands_exist():
    missing = []
    for name, command, _ in COMMANDS:
        for word in shlex.split(_fill(command).replace("$(", " ").replace(")", " "), posix=True):
            if re.match(r"(infra|benchmarks|tests|examples|\.ci)/", word) and not list(REPO.glob(word)):
                missing.append(f"{name}: {command}: {word}")
    assert not missing, "README commands name files that do not exist:\n" + "\n".join(missing)


def test_flywheel_commands_parse_as_the_cli_defines_them(installed_env):
    import typer
    from typer.main import get_command

    from flywheel.cli import app

    group = get_command(app)
    printer = f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
    failures = []
    for name, command, complete in COMMANDS:
        if classify(command) != "flywheel":
            continue
        shown = _shell(printer + _fill(command).removeprefix("flywheel"), installed_env)
        assert shown.returncode == 0, f"{name}: {command}: bash could not expand it: {shown.stderr}"
        argv = json.loads(shown.stdout.splitlines()[-1])
        sub = group.commands.get(argv[0]) if argv else None
        if sub is None:
            failures.append(f"{name}: {command}: no subcommand {argv[:1]}")
            continue
        try:
            sub.make_context(f"flywheel {argv[0]}", argv[1:])
        except typer.TyperException as err:  # typer's own click: a usage error (unknown option, missing argument)
            # prose may name an option without its value, or leave out a required argument
            if complete or type(err).__name__ not in ("MissingParameter", "BadOptionUsage"):
                failures.append(f"{name}: {command}: {err}")
    assert not failures, "README flywheel commands the CLI refuses:\n" + "\n".join(failures)


@pytest.mark.slow  # `flywheel check` times SmolLM2 (twice: fp32 and bf16 pipelines) for its estimates
def test_flywheel_entry_point_and_cheap_commands_run(installed_env, tmp_path):
    named = {command for _, command, _ in COMMANDS}
    assert set(RUN_HERE) <= named, f"RUN_HERE names commands the README no longer shows: {set(RUN_HERE) - named}"
    listed = _shell("flywheel --help", installed_env)
    assert listed.returncode == 0, listed.stderr
    for sub in {c.split()[1] for c in named if classify(c) == "flywheel"}:
        assert re.search(rf"│ {sub}\s", listed.stdout), f"`flywheel --help` does not list {sub}"
    # state in temporary folders, not the checkout's .flywheel/
    env = installed_env | {"MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
                           "PREFECT_HOME": str(tmp_path / "prefect")}
    checked = _shell("flywheel check", env)
    assert checked.returncode == 0 and "pipelines.yaml: ok (demo" in checked.stdout, checked.stdout + checked.stderr
    status = _shell("flywheel status demo", env)
    assert status.returncode == 0, status.stdout + status.stderr
    assert "demo: no registered version yet" in status.stdout and "next scheduled run:" in status.stdout


def test_generating_dvc_yaml_as_the_readme_shows_gives_the_checked_in_file(installed_env):
    shown = [c for _, c, _ in COMMANDS if classify(c) == "generate"]
    assert shown, "the README no longer says how dvc.yaml is generated"
    for command in set(shown):  # with --check: the checkout's dvc.yaml is compared, not replaced
        ran = _shell(command + " --check", installed_env)
        assert ran.returncode == 0, f"`{command}` gives another dvc.yaml than the one here: {ran.stdout}{ran.stderr}"
        assert "up to date" in ran.stdout, ran.stdout


def test_make_targets_exist_and_call_what_the_readme_says(installed_env):
    targets = {command.split()[1] for _, command, _ in COMMANDS if classify(command) == "make"}
    assert targets <= set(MAKE_CALLS), f"make targets with no expectation in MAKE_CALLS: {targets - set(MAKE_CALLS)}"
    for target in targets | {"bench"}:
        planned = _shell(f"make -n {target}", installed_env)
        assert planned.returncode == 0, f"make -n {target}: {planned.stderr}"
        for call in MAKE_CALLS[target]:
            assert call in planned.stdout, f"`make {target}` does not call {call}:\n{planned.stdout}"
    bench = _shell("make -n bench", installed_env).stdout
    unrun = [p.name for p in _benchmarks() if f"benchmarks/{p.name}" not in bench and p.name not in GPU_ONLY
             and p.name not in NEEDS_A_CLONE]
    assert not unrun, f"`make bench` does not run {unrun}"


def test_tool_commands_exist_with_the_options_the_readme_passes(installed_env):
    asked = {}
    for name, command, _ in COMMANDS:
        if classify(command) == "help":
            sub = next(s for s in TOOL_SUBCOMMANDS if command == s or command.startswith(s + " "))
            asked.setdefault(sub, []).append((name, command))
    failures = []
    for sub, uses in asked.items():
        shown = _shell(f"{sub} --help", installed_env, timeout=120)
        if shown.returncode != 0:
            failures.append(f"{sub} --help: exit {shown.returncode}: {shown.stderr[-500:]}")
            continue
        for name, command in uses:
            for option in re.findall(r"(?:^|\s)(--?[\w-]+)", command):
                if not re.search(rf"(^|[\s,\[]){re.escape(option)}\b", shown.stdout):
                    failures.append(f"{name}: {command}: `{sub} --help` has no {option}")
    assert not failures, "\n".join(failures)


def test_the_openai_test_server_starts_answers_and_stops(installed_env):
    import httpx

    commands = [c for _, c, _ in COMMANDS if classify(c) == "server"]
    assert commands
    for command in commands:
        server = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=REPO, env=installed_env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            url = server.stdout.readline().strip()
            assert url.startswith("http"), f"{command}: printed {url!r}; {server.stderr.read() if not url else ''}"
            assert httpx.get(f"{url}/models", timeout=30).status_code == 200
        finally:
            server.terminate()
            server.wait(timeout=30)


def _benchmarks() -> list[Path]:
    return [p for p in sorted((REPO / "benchmarks").glob("*.py"))
            if p.name not in NOT_RUN_HERE and not p.name.startswith("_")]  # _scratch.py: a helper, no benchmark


def test_readme_benchmarks_are_the_ones_run_here():
    scripts = {re.search(r"benchmarks/(\w+\.py)", c).group(1) for _, c, _ in COMMANDS if classify(c) == "benchmark"}
    assert scripts, "the README names no benchmark"
    known = {p.name for p in _benchmarks()} | set(NOT_RUN_HERE)
    assert scripts <= known, scripts - known
    assert {p.name for p in _benchmarks()} <= set(FIGURES), "a benchmark with no FIGURES entry"


@pytest.mark.slow
@pytest.mark.parametrize("script", [p.name for p in _benchmarks()])
def test_benchmark_runs_quick_as_the_readme_shows_and_prints_its_figures(script, installed_env, tmp_path):
    shown = [c for _, c, _ in COMMANDS if classify(c) == "benchmark" and f"benchmarks/{script}" in c]
    command = (shown[0] if shown else f"python benchmarks/{script}") + " --quick"
    temporary = tmp_path / "tmp"  # its own TMPDIR: a benchmark removes the temporary folders it made
    temporary.mkdir()
    ran = _shell(command, installed_env | {"TMPDIR": str(temporary)})
    assert ran.returncode == 0, f"{command}: exit {ran.returncode}\n{ran.stdout[-2000:]}\n{ran.stderr[-3000:]}"
    figures = json.loads(ran.stdout.strip().splitlines()[-1])
    assert FIGURES[script] <= set(figures), f"{script}: JSON line lacks {FIGURES[script] - set(figures)}"
    left = sorted(p.name for p in temporary.iterdir() if not p.name.startswith("torchinductor_"))  # torch's cache
    assert not left, f"{script} left {left} behind"


@pytest.mark.slow
def test_run_compare_and_status_on_a_small_pipeline(project, installed_env):
    from mlflow import MlflowClient

    env = installed_env | {"MLFLOW_TRACKING_URI": os.environ["MLFLOW_TRACKING_URI"]}
    wanted = [c for _, c, _ in COMMANDS if re.match(r"flywheel (run|compare|status) demo( |$)", c)
              and "--refresh" not in c]
    runs = [c for c in wanted if c.startswith("flywheel run ")]
    assert runs and any(c.startswith("flywheel compare") for c in wanted), wanted
    for _ in range(2):  # two retrain runs to compare (the second from Prefect's cache)
        ran = _shell(runs[0].replace(" demo", " small", 1), env, cwd=project)
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    client = MlflowClient()
    experiment = client.get_experiment_by_name("small")
    ids = [r.info.run_id for r in client.search_runs([experiment.experiment_id],
                                                     "tags.`flywheel.stage` = 'retrain'")]
    assert len(ids) == 2
    for command in dict.fromkeys(wanted):
        if command.startswith("flywheel run "):
            continue
        ran = _shell(_fill(command.replace(" demo", " small", 1), ids), env, cwd=project)
        assert ran.returncode == 0, f"{command}:\n{ran.stdout[-3000:]}{ran.stderr[-3000:]}"
        if command.startswith("flywheel compare"):
            assert ids[0][:8] in ran.stdout and ids[1][:8] in ran.stdout, ran.stdout
        if "--html" in command:
            html = project / shlex.split(command)[shlex.split(command).index("--html") + 1]
            assert "data:image/png;base64" in html.read_text()
        if command.startswith("flywheel status"):
            assert "champion" in ran.stdout and ids[0][:8] in ran.stdout, ran.stdout
