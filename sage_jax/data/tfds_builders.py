"""TFDS builders (array_record files) for the problem sets, usable without TensorFlow.

Each builder reads the local source layout of `loaders.DATASETS` (math500/test.jsonl, ...) and writes every split whose
files exist. Records hold text only: problem, answer, id and meta_json (the rest of the row as JSON), so one schema
serves all sets. Reading goes through `builder.as_data_source()`, which needs array_record but not TensorFlow;
point `data_dir` (or $TFDS_DATA_DIR) at a bucket to share prepared sets with pod workers
(gs:// paths need a GCS file backend for etils/array_record; only local folders are tested here).

  build("math500", source_dir="/work/shared/data", tfds_data_dir="/tmp/tfds")
  examples = load_from_tfds("math500", "test", "/tmp/tfds")
  # or, once this module is imported: tfds.data_source("sage_math500", split="test", data_dir="/tmp/tfds")
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds
from etils import epath

from sage_jax.data import loaders

_VERSION = "1.0.0"


class _ProblemSet(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base builder; subclasses set `name` (the TFDS name) and `source_name` (the loaders.DATASETS key)."""

    VERSION = tfds.core.Version(_VERSION)
    RELEASE_NOTES = {_VERSION: "Text records problem / answer / id / meta_json from the shared jsonl/parquet files."}
    source_name = ""

    # TFDS's default code_path lookup imports `importlib_resources`, which tensorflow-datasets 4.9.10 does not
    # declare as a dependency; the builders keep no checksums or metadata next to their code anyway.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        return epath.Path(__file__)

    def __init__(self, *, source_dir: str | os.PathLike | None = None, **kwargs: Any):
        self._source_dir = Path(source_dir) if source_dir else loaders.default_data_dir()
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict({
            "problem": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "id": tfds.features.Text(),
            "meta_json": tfds.features.Text(),
        })
        return tfds.core.DatasetInfo(builder=self, description=f"sage_jax copy of {self.source_name}",
                                     features=features, disable_shuffling=True)

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        del dl_manager  # everything is local
        spec = loaders.DATASETS[self.source_name]
        splits = {}
        for split, patterns in spec.files.items():
            paths = [p for pattern in patterns for p in sorted(Path(self._source_dir).glob(pattern))]
            if paths and all(p.is_file() for p in paths):
                splits[split] = self._generate_examples(split)
        if not splits:
            raise FileNotFoundError(f"no source files for {self.source_name!r} under {self._source_dir}: expected"
                                    f" {spec.files}; pass source_dir= pointing at the shared data folder")
        return splits

    def _generate_examples(self, split: str):
        examples = loaders.load_dataset(self.source_name, split, data_dir=self._source_dir)
        for i, ex in enumerate(examples):
            meta = dict(ex.meta)
            meta.pop("source", None)  # machine-specific path
            yield i, {"problem": ex.problem, "answer": ex.answer, "id": str(meta.get("id", i)),
                      "meta_json": json.dumps(meta, ensure_ascii=False, default=str)}


def _make_builder(source_name: str) -> type[_ProblemSet]:
    class_name = "Sage" + "".join(part.capitalize() for part in source_name.split("_"))
    return type(class_name, (_ProblemSet,), {"name": f"sage_{source_name}", "source_name": source_name,
                                             "__module__": __name__})


BUILDERS: dict[str, type[_ProblemSet]] = {name: _make_builder(name) for name in loaders.DATASETS}


def _builder_class(name: str) -> type[_ProblemSet]:
    if name not in BUILDERS:
        raise ValueError(f"no TFDS builder for {name!r}; available: {sorted(BUILDERS)}")
    return BUILDERS[name]


def _tfds_dir(tfds_data_dir: str | os.PathLike | None) -> str:
    path = tfds_data_dir or os.environ.get("TFDS_DATA_DIR")
    if not path:
        raise ValueError("no TFDS data dir: pass tfds_data_dir= / data_dir= or set TFDS_DATA_DIR")
    return str(path)


def build(name: str, source_dir: str | os.PathLike | None = None, tfds_data_dir: str | os.PathLike | None = None,
          quiet: bool = True) -> Path:
    """Prepare the array_record TFDS copy of dataset `name`; returns the version folder."""
    if quiet:
        tfds.disable_progress_bar()
    builder = _builder_class(name)(source_dir=source_dir, data_dir=_tfds_dir(tfds_data_dir),
                                   file_format="array_record")
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return Path(builder.data_dir)


def _version_dir(name: str, data_dir: str) -> epath.Path:
    root = epath.Path(data_dir) / f"sage_{name}"
    versions = [p for p in root.iterdir() if (p / "dataset_info.json").exists()] if root.exists() else []
    if not versions:
        raise FileNotFoundError(f"no prepared TFDS dataset sage_{name} under {data_dir}; run"
                                f" sage_jax.data.tfds_builders.build({name!r}, source_dir, {data_dir!r}) first")
    return max(versions, key=lambda p: tfds.core.Version(p.name))


def load_from_tfds(name: str, split: str = "test", data_dir: str | os.PathLike | None = None) -> list[loaders.Example]:
    """Examples read back from a prepared array_record TFDS dataset (no TensorFlow needed)."""
    builder = tfds.builder_from_directory(_version_dir(name, _tfds_dir(data_dir)))
    if split not in builder.info.splits:
        raise ValueError(f"sage_{name} has no split {split!r}; available: {sorted(builder.info.splits)}")
    source = builder.as_data_source(split=split)
    examples = []
    for i in range(len(source)):
        record = {k: v.decode("utf-8") if isinstance(v, bytes) else v for k, v in source[i].items()}
        examples.append(loaders.Example(record["problem"], record["answer"], json.loads(record["meta_json"])))
    return examples
