"""The README's generated blocks are rewritten from outputs, never typed in."""

import json

import pytest

from trapo import readme


def test_replace_block_and_missing_markers():
    text = "intro\n<!-- generated:x -->\nold\nlines\n<!-- /generated:x -->\noutro\n"
    assert (
        readme.replace_block(text, "x", "new\n") == "intro\n<!-- generated:x -->\nnew\n<!-- /generated:x -->\noutro\n"
    )
    with pytest.raises(ValueError, match="no block 'y'"):
        readme.replace_block(text, "y", "z")


def test_make_train_block_from_a_run(tmp_path):
    run = tmp_path / "toy"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"steps": 3, "heldout_accuracy_after": 0.5, "selection": None}))
    target = tmp_path / "README.md"
    target.write_text("<!-- generated:make-train -->\n<!-- /generated:make-train -->\n")
    assert readme.main(["--train", str(run), "--readme", str(target)]) == 0
    assert "trained 3 steps\nheld-out accuracy after: 0.500" in target.read_text()
    assert readme.main(["--train", str(tmp_path / "none"), "--readme", str(target)]) == 2  # no summary.json
