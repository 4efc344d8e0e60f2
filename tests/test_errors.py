"""path_refusal: the operating system's refusal of a path as one line naming it; other OSErrors are not its."""

import errno
import os

from fora_plugin.errors import FoRAInputError, path_refusal


def test_a_path_too_long_is_named_with_its_key(tmp_path):
    path = tmp_path / ("x" * 300)
    try:
        path.stat()
    except OSError as error:
        refusal = path_refusal(error, "output_dir")
    assert isinstance(refusal, FoRAInputError)
    assert str(refusal).startswith(f"output_dir={str(path)!r} is invalid: the operating system refuses it (")
    assert "Use a shorter path" in str(refusal)


def test_a_file_where_a_folder_must_be_names_the_file(tmp_path):
    (tmp_path / "data.json").write_text("[]")
    try:
        (tmp_path / "data.json" / "rows.json").read_text()
    except OSError as error:
        refusal = path_refusal(error)
    assert f"the path {str(tmp_path / 'data.json' / 'rows.json')!r} is refused" in str(refusal)
    assert f"{tmp_path / 'data.json'} is a file, not a folder" in str(refusal)


def test_other_os_errors_are_the_callers():
    assert path_refusal(FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/nowhere")) is None
    assert path_refusal(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/full")) is None
    assert path_refusal(OSError(errno.EACCES, os.strerror(errno.EACCES))) is None  # no path to name
    refusal = path_refusal(PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/locked/x"), "--output")
    assert "--output='/locked/x' is invalid" in str(refusal) and "fix its permissions" in str(refusal)
