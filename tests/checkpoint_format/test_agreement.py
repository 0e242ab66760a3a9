"""What a rank reports about a checkpoint path (the multi-node behaviour is in tests/strategies/test_multinode.py)."""

from __future__ import annotations

import os

from lightning_sink.checkpoint_format.agreement import describe_path


def test_describe_path_lists_names_one_level_deep_and_never_follows_links(tmp_path):
    assert describe_path(tmp_path / "absent") is None
    (tmp_path / "file.ckpt").write_bytes(b"x")
    assert describe_path(tmp_path / "file.ckpt") == ("<file>",)
    folder = tmp_path / "resharded"
    (folder / "rank_0").mkdir(parents=True)
    (folder / "rank_0" / "checkpoint_0.pt").write_bytes(b"x")
    (folder / "MANIFEST.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("x")
    os.symlink(outside, folder / "link")
    assert describe_path(folder) == ("MANIFEST.json", "link", "rank_0/", "rank_0/checkpoint_0.pt")
