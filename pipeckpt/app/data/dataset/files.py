"""The user's data files, read by the ``datasets`` library, and named by file and row when they are
wrong.

``datasets`` reads JSON Lines, JSON, Parquet, CSV and Arrow files into one table and caches it where it
keeps its cache (``HF_DATASETS_CACHE``), never beside the user's files. A ``save_to_disk`` directory is
read through the same ``arrow`` builder rather than ``load_from_disk``: ``load_from_disk`` writes the
caches of later steps (tokenizing) into the user's folder.

Why the checks here: the library reports an empty file as a bare ``StopIteration``, a broken JSON line
as "An error occurred while generating the dataset", and decodes a non-UTF-8 line into replacement
characters without a word. Each is found before or after the library's read and named: file, line.
"""

import json
from pathlib import Path
from typing import Any, List, Optional, Tuple

from pipeckpt._errors import config_error

__all__ = ["DataFiles", "find_files", "load_tables"]

#: The ``datasets`` builder reading each file suffix.
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
#: Text formats, whose bytes are checked as UTF-8 line by line.
_TEXT = {".jsonl", ".json", ".csv"}


class DataFiles:
    """The files one setting names: ``builder`` reads them, in ``files``' order.

    Args:
        setting: the user's setting and value (``data.path=chat.jsonl``), for messages.
        builder: the ``datasets`` builder (``json``, ``parquet``, ``csv``, ``arrow``).
        files: the files, in the order their rows are read.
    """

    def __init__(self, setting: str, builder: str, files: List[Path]) -> None:
        self.setting, self.builder, self.files = setting, builder, files


def _refuse(setting: str, rule: str) -> Exception:
    return config_error(
        setting,
        rule,
        "point it at a .jsonl, .json, .parquet, .csv or .arrow file, a directory of such files (one kind), "
        "or a directory written by datasets' save_to_disk",
    )


def find_files(path: str, setting: str = "data.path", split: str = "train") -> DataFiles:
    """The files ``path`` names: a file, a directory of files of one kind, or a ``save_to_disk``
    directory (a ``DatasetDict``'s ``split``)."""
    root = Path(path).expanduser()
    named = f"{setting}={path}"
    if not root.exists():
        raise _refuse(named, "no such file or directory")
    if root.is_file():
        if root.suffix not in _BUILDERS:
            raise _refuse(named, f"pipeckpt reads no {root.suffix or 'suffix-less'} file")
        return DataFiles(named, _BUILDERS[root.suffix], [root])
    if (root / "dataset_dict.json").is_file():  # a DatasetDict's save_to_disk: one folder a split
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise config_error(
                named,
                f"this save_to_disk directory holds the splits {splits}, not {split!r}",
                f"point {setting} at one split's folder ({root / splits[0] if splits else root})",
            )
        root = root / split
    if (root / "state.json").is_file():  # one Dataset's save_to_disk: its .arrow files hold the rows
        return DataFiles(named, "arrow", sorted(root.glob("*.arrow")))
    files = sorted(f for f in root.iterdir() if f.is_file() and f.suffix in _BUILDERS)
    kinds = sorted({_BUILDERS[f.suffix] for f in files})
    if not files:
        raise _refuse(named, "the directory holds no data file")
    if len(kinds) > 1:
        raise _refuse(named, f"the directory mixes {' and '.join(kinds)} files, which hold different columns")
    return DataFiles(named, kinds[0], files)


def _check_bytes(files: DataFiles) -> None:
    """Refuses an empty file, and a text file with a line that is not UTF-8, by line."""
    for file in files.files:
        data = file.read_bytes()
        if not data.strip():
            raise config_error(
                f"{files.setting}: {file.name}", "the file is empty", "remove it, or fill it with rows"
            )
        if file.suffix not in _TEXT:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:
            line = data.count(b"\n", 0, error.start) + 1
            raise config_error(
                f"{files.setting}: line {line} of {file.name}",
                f"the line is not UTF-8 (byte {data[error.start]:#04x})",
                "write the file as UTF-8 (e.g. iconv -t UTF-8), or remove the line",
            ) from None


def _broken_json_line(file: Path) -> Optional[Tuple[int, str]]:
    """The first line of a JSON Lines ``file`` that is not one JSON object, with why."""
    for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            return number, f"it is not JSON ({error.msg} at column {error.colno})"
        if not isinstance(row, dict):
            return number, f"it is a JSON {type(row).__name__}, not an object of fields"
    return None


def load_tables(files: DataFiles) -> List[Tuple[Path, Any]]:
    """Each file of ``files`` with its rows as a ``datasets.Dataset``, read once and cached by
    ``datasets``. One table a file: its rows are named in it, and files whose other columns differ
    (one file's row carrying a column the others lack) still read."""
    try:
        import datasets
    except ImportError:
        raise config_error(
            "data=dataset",
            "it reads files with the datasets library, which is not installed",
            'pip install "pipeckpt[hf]" (or pip install datasets)',
        ) from None

    _check_bytes(files)
    tables = []
    for file in files.files:
        try:
            table = datasets.load_dataset(files.builder, data_files=[str(file)], split="train")
        except Exception as error:  # the library names neither the file nor the line
            broken = _broken_json_line(file) if file.suffix == ".jsonl" else None
            if broken is not None:
                raise config_error(
                    f"{files.setting}: line {broken[0]} of {file.name}",
                    broken[1],
                    "each line of a .jsonl file is one JSON object; fix or remove the line",
                ) from None
            raise config_error(
                f"{files.setting}: {file.name}",
                f"datasets could not read it as {files.builder} ({type(error).__name__}: {error})",
                "check that the file is valid for its suffix",
            ) from None
        if len(table) == 0:
            raise config_error(
                f"{files.setting}: {file.name}", "it holds no rows", "remove it, or fill it with rows"
            )
        tables.append((file, table))
    return tables
