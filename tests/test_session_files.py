"""The one atomic, fsynced writer both servers' session files go through (``lstmem_peft.memory.sessions``):
the new file replaces the old whole, readable by its owner only; a write that fails, or is
interrupted, leaves the old file as it was and no temporary file behind."""

from __future__ import annotations

import os
import stat

import pytest

from lstmem_peft.memory.sessions import SessionIdError, session_file, write_atomically


def test_a_write_replaces_the_file_whole_and_only_its_owner_reads_it(tmp_path):
    target = tmp_path / "s.safetensors"
    target.write_text("old")
    write_atomically(target, lambda tmp: open(tmp, "w").write("new"))
    assert target.read_text() == "new"
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_write_leaves_the_old_file_and_no_temporary_file(tmp_path, failure):
    target = tmp_path / "s.safetensors"
    target.write_text("old")

    def write(tmp):
        open(tmp, "w").write("half")
        raise failure

    with pytest.raises(type(failure)):
        write_atomically(target, write)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def test_a_missing_folder_is_an_error_not_a_file_elsewhere(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "missing" / "s.safetensors", lambda tmp: open(tmp, "w").write("x"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name",
    [
        "..",
        "../x",
        ".hidden",
        "a/..",
        "a/./b",
        "a//b",
        "/a/b",
        "a/b/",
        "a/b/c/d",
        "a/.b",
        "",
        "x" * 129,
        "a\n",
    ],
)
def test_a_session_name_that_could_leave_its_folder_is_refused(tmp_path, name):
    with pytest.raises(SessionIdError, match="invalid session id"):
        session_file(str(tmp_path), name)


def test_a_session_name_may_join_up_to_three_plain_names_inside_the_folder(tmp_path):
    """``lstmem serve --engine vllm`` names its store's own files (``NAMESPACE/SESSION/memory-N``);
    a folder inside that is a link to elsewhere is refused as a file link is."""
    root = os.path.realpath(tmp_path)
    assert session_file(str(tmp_path), "public/alice/memory-00000003") == os.path.join(
        root, "public", "alice", "memory-00000003.safetensors"
    )
    assert session_file(str(tmp_path), "public/alice") == os.path.join(root, "public", "alice.safetensors")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "ns").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match="resolves outside the session directory"):
        session_file(str(tmp_path / "sessions"), "ns/alice/memory-1")
