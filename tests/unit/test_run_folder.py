"""A bad --output_dir is refused before anything is built: a dangling symbolic link says what to do (the lock
of a folder in use, and the commands: tests/integration/test_run_folder_commands.py)."""

from __future__ import annotations

from training_helpers import resume_chat_data, tiny_overrides

from lowmem.cli import main


def test_an_output_dir_that_is_a_dangling_link_fails_with_what_to_do(tmp_path, capsys):
    chat_data = resume_chat_data(tmp_path)
    (tmp_path / "run").symlink_to(tmp_path / "unmounted" / "disk")
    for output_dir in (tmp_path / "run", tmp_path / "run" / "sub"):
        assert main(["train", *tiny_overrides(tmp_path, *chat_data), "--max_steps=2",
                     f"--output_dir={output_dir}"]) == 2
        stderr = capsys.readouterr().err
        assert "Traceback" not in stderr
        assert f"{tmp_path / 'run'} is a symbolic link to {tmp_path / 'unmounted' / 'disk'}, which does not exist" \
            in stderr
    assert (tmp_path / "run").is_symlink() and not (tmp_path / "unmounted").exists()
    assert not (tmp_path / "tok").exists(), "nothing was built: not even the tokenizer"
