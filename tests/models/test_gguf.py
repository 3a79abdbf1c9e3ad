"""models/gguf.py's file checks: a GGUF file cut short anywhere is named as truncated before transformers reads it."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from sage_jax.models import gguf as gguf_model  # noqa: E402


def _write(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("a", np.ones((64, 64), np.float32))
    w.add_tensor("b", np.ones((128,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_whole_file_passes(tmp_path):
    assert gguf_model.check_gguf_file(_write(tmp_path / "m.gguf")) == tmp_path / "m.gguf"


@pytest.mark.parametrize("keep", [0.999, 0.5, 100, 30])
def test_a_cut_file_is_named_truncated(tmp_path, keep):
    data = _write(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match="truncated"):
        gguf_model.check_gguf_file(cut)


def test_convert_names_a_truncated_file_through_the_face(tmp_path, capsys):
    from sage_jax import convert_gguf
    from sage_jax.run import cli
    data = _write(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(SystemExit) as exit_info:
        cli.main_guard(lambda: convert_gguf.main([str(tmp_path / "cut.gguf"), str(tmp_path / "out")]))
    assert exit_info.value.code != 0 and "truncated" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
