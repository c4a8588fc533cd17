"""Tests for thin.compiler.corpus: the stdlib-derived text splits."""

import subprocess
import sys

from thin.compiler import corpus


def test_heldout_modules_exist_and_are_top_level():
    root = corpus.stdlib_dir()
    paths = corpus.heldout_files()
    assert [p.name for p in paths] == list(corpus.HELDOUT_MODULES)
    assert len(set(corpus.HELDOUT_MODULES)) == len(corpus.HELDOUT_MODULES)
    for p in paths:
        assert p.is_file() and p.parent == root


def test_training_disjoint_from_heldout():
    train = corpus.training_files()
    assert len(train) > 100
    held = set(corpus.heldout_files())
    assert held.isdisjoint(train)
    names = {p.relative_to(corpus.stdlib_dir()).as_posix() for p in train}
    assert names.isdisjoint(corpus.HELDOUT_MODULES)


def test_training_skips_tests_site_packages_and_caches():
    root = corpus.stdlib_dir()
    for p in corpus.training_files():
        assert p.suffix == ".py"
        parts = p.relative_to(root).parts[:-1]
        for skipped in ("site-packages", "test", "tests", "idle_test", "__pycache__"):
            assert skipped not in parts, p


def test_training_files_sorted_and_deterministic():
    root = corpus.stdlib_dir()
    a = corpus.training_files()
    rel = [p.relative_to(root).as_posix() for p in a]
    assert rel == sorted(rel)
    assert a == corpus.training_files()


def test_heldout_text_deterministic_and_plain():
    text = corpus.heldout_text()
    assert text == corpus.heldout_text()
    assert "<|endoftext|>" not in text and "<|im_start|>" not in text
    for name in corpus.HELDOUT_MODULES:
        assert corpus.HELDOUT_SEPARATOR.format(name=name).strip() in text
    assert "def dedent(" in text  # from textwrap.py
    assert "class SequenceMatcher" in text  # from difflib.py


def test_calibration_text_deterministic_sized_and_disjoint():
    a = corpus.calibration_text(20_000)
    assert len(a) == 20_000
    assert a == corpus.calibration_text(20_000)
    assert corpus.calibration_text(5_000) == a[:5_000]
    assert corpus.calibration_text(0) == ""
    assert corpus.calibration_text(5_000, seed=1) != a[:5_000]
    held = corpus.heldout_text()
    # Spot check: no 200-character slice of calibration text occurs in the held-out text.
    for i in range(0, len(a) - 200, 997):
        assert a[i : i + 200] not in held


def test_import_needs_no_torch():
    code = "import sys, thin.compiler.corpus; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
