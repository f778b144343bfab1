"""The README and the pages in docs/ say what the code does: their code blocks run.

- Every fenced ``python`` block runs, a page's blocks in order in one namespace (a later block
  may use an earlier one's names), in a temporary directory. A block that cannot run here (it
  needs a GPU, SLURM, several nodes) is marked by the line right before its fence:
  ``<!-- not run: the reason -->``.
- Every ``python train.py ...`` line of a ``bash`` block composes with the app's configs (each
  value of a ``-m`` sweep); every ``python -m pipeckpt.X`` names a module that exists and every
  repository path a command names exists; the ``python -m pipeckpt.plan`` lines run (slow).
- docs/SETTINGS.md's table equals what ``python scripts/settings_page.py`` writes.
- Every relative link between the pages points at a file that exists.
"""

import importlib.util
import itertools
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from support import forkserver

from pipeckpt.app.config import register

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.+?)\s*-->")
FENCE = re.compile(r"^```(\w*)\s*$")
#: pages whose python blocks train a Hugging Face model each: seconds apiece, but several of them.
SLOW_PAGES = {"REAL_MODELS.md", "FINE_TUNING.md"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    not_run: str  # the reason, or "" when the block runs

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> Iterator[Block]:
    """The fenced code blocks of one markdown page, in order."""
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        start = i
        i += 1
        while i < len(lines) and lines[i].rstrip() != "```":
            i += 1
        before = lines[start - 1] if start > 0 else ""
        marker = NOT_RUN.search(before)
        yield Block(
            page=page,
            line=start + 1,
            language=opening.group(1),
            code="\n".join(lines[start + 1 : i]) + "\n",
            not_run=marker.group(1) if marker else "",
        )
        i += 1


def _python_pages() -> List[object]:
    params: List[object] = []
    for page in PAGES:
        if not any(b.language == "python" for b in blocks(page)):
            continue
        marks = [pytest.mark.slow] if page.name in SLOW_PAGES else []
        params.append(pytest.param(page, id=page.name, marks=marks))
    return params


def _commands(language: str = "bash") -> List[Block]:
    """One Block per command line of every ``bash`` block (comments and blank lines dropped)."""
    found = []
    for page in PAGES:
        for block in blocks(page):
            if block.language != language or block.not_run:
                continue
            for offset, line in enumerate(block.code.splitlines(), start=1):
                command = line.split(" #", 1)[0].strip()
                if command and not command.startswith("#"):
                    found.append(Block(page, block.line + offset, language, command, ""))
    return found


def _argv(command: str) -> List[str]:
    return shlex.split(command.replace("<", "_").replace(">", "_"))  # placeholders such as <run>


# -- python blocks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("page", _python_pages())
def test_every_python_block_of_the_page_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    if page.name == "REAL_MODELS.md":
        pytest.importorskip("transformers", reason="the page's models come from the hf extra")
    monkeypatch.chdir(tmp_path)  # Lightning's logs and checkpoints land here
    namespace: Dict[str, object] = {"__name__": f"docs_{page.stem.lower()}"}
    ran = 0
    for block in blocks(page):
        if block.language != "python" or block.not_run:
            continue
        code = compile(block.code, block.where, "exec")
        try:
            exec(code, namespace)
        except Exception as error:
            raise AssertionError(f"the python block at {block.where} failed: {error!r}") from error
        ran += 1
    assert ran > 0, f"{page.name}: every python block is marked not run"


def test_blocks_marked_not_run_are_few_and_say_why():
    marked = [b for page in PAGES for b in blocks(page) if b.not_run]
    assert all(len(b.not_run) > 5 for b in marked), [b.where for b in marked]
    assert len(marked) <= 5, [b.where for b in marked]


def test_the_readme_example_is_a_short_lightning_module_under_the_pipe_strategy():
    (example,) = [b for b in blocks(ROOT / "README.md") if b.language == "python"]
    assert "configure_pipeline" in example.code and "PipelineStrategy" in example.code
    assert len(example.code.splitlines()) <= 30


# -- bash blocks -------------------------------------------------------------------------------------


def _train_overrides(argv: List[str]) -> List[List[str]]:
    """The override lists one ``python train.py`` line composes: one per point of a ``-m`` sweep."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    overrides = [a for a in argv if a not in ("-m", "--multirun")]
    if not multirun:
        return [overrides]
    choices = []
    for raw, parsed in zip(overrides, OverridesParser.create().parse_overrides(overrides)):
        if parsed.is_sweep_override():
            key = raw.split("=", 1)[0]
            choices.append([f"{key}={value}" for value in parsed.sweep_string_iterator()])
        else:
            choices.append([raw])
    return [list(point) for point in itertools.product(*choices)]


def _train_lines() -> List[object]:
    return [
        pytest.param(c, id=c.where)
        for c in _commands()
        if _argv(c.code)[:2] == ["python", "train.py"] and not any(a.startswith("--") for a in _argv(c.code))
    ]


@pytest.mark.parametrize("command", _train_lines())
def test_every_train_command_composes_with_the_configs(command: Block, tmp_path: Path):
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for overrides in _train_overrides(_argv(command.code)[2:]):
            try:
                compose("train", overrides=[f"output_dir={tmp_path}", *overrides])
            except Exception as error:
                raise AssertionError(
                    f"{command.where}: `{command.code}` does not compose: {error}"
                ) from error


def test_every_command_names_modules_and_files_that_exist():
    assert _train_lines(), "no `python train.py` line found: the block parser is broken"
    for command in _commands():
        argv = _argv(command.code)
        if argv[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(argv[2]) is not None, f"{command.where}: no module {argv[2]}"
        for arg in argv:
            if re.match(r"^(scripts|examples|benchmarks|conf)/\S+\.\w+$", arg):
                assert (ROOT / arg).exists(), f"{command.where}: {arg} does not exist"
            if arg.endswith(".py") and "/" not in arg and argv[0] == "python":
                assert (ROOT / arg).exists(), f"{command.where}: {arg} does not exist"


def _plan_lines() -> List[object]:
    return [
        pytest.param(c, id=c.where)
        for c in _commands()
        if _argv(c.code)[:3] == ["python", "-m", "pipeckpt.plan"] and "..." not in c.code
    ]


@pytest.mark.slow
@pytest.mark.parametrize("command", _plan_lines())
def test_every_plan_command_runs(command: Block, tmp_path: Path):
    done = forkserver.run(
        [sys.executable, *_argv(command.code)[1:]],
        cwd=tmp_path,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, f"{command.where}: `{command.code}`\n{done.stdout}\n{done.stderr}"


# -- the settings page and the links -----------------------------------------------------------------


def _settings_page_module():
    spec = importlib.util.spec_from_file_location("settings_page", ROOT / "scripts" / "settings_page.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_page_is_what_the_generator_writes():
    generator = _settings_page_module()
    page = generator.PAGE.read_text()
    assert page == generator.render(page), (
        f"docs/SETTINGS.md is out of date with PipeSettings: run `{generator.COMMAND}`"
    )


def test_the_settings_table_lists_every_field_of_pipe_settings():
    import dataclasses

    from pipeckpt.settings import PipeSettings

    table = _settings_page_module().table()
    for f in dataclasses.fields(PipeSettings):
        assert f"| `{f.name}` |" in table and f.metadata["help"] in table, f.name


def _anchors(page: Path) -> List[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.MULTILINE)
    return [re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings]


def test_every_relative_link_between_the_pages_points_at_a_file_and_heading():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            assert path.exists(), f"{page.relative_to(ROOT)}: the link {target} points at nothing"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{page.relative_to(ROOT)}: no heading #{anchor} in {file}"


def test_the_pages_cite_no_issue_numbers():
    for page in PAGES:
        found = re.findall(r"(?i)\bissue \d+|(?<![\w&/])#\d{1,3}\b", page.read_text())
        assert not found, f"{page.relative_to(ROOT)}: {found} (a reader cannot look these up)"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 210, len(lines)
    assert "bash scripts/setup.sh --test && python -m pytest" in lines
    assert "bash scripts/setup.sh && python train.py" in lines


def test_what_the_code_points_to_in_the_docs_exists():
    """A docstring's ``docs/DESIGN.md, <folder>/<module>`` names a section of that page, and every
    ``docs/*.md`` or ``benchmarks/RESULTS*.md`` it names is a file."""
    sections = set(re.findall(r"^## (\S+)$", (ROOT / "docs" / "DESIGN.md").read_text(), flags=re.MULTILINE))
    for source in sorted((ROOT / "pipeckpt").rglob("*.py")):
        text = source.read_text()
        where = source.relative_to(ROOT)
        for section in re.findall(r"docs/DESIGN\.md,\s+([\w/]+)", text):
            assert section in sections, f"{where}: docs/DESIGN.md has no section {section}"
        for name in re.findall(r"\b((?:docs/\w+|benchmarks/RESULTS\w*)\.md)\b", text):
            assert (ROOT / name).exists(), f"{where}: {name} does not exist"
