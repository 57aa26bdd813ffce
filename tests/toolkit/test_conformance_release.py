"""The conformance runner and the doubts checker take the release as a parameter
(``kvcache.kit.conformance``, ``kvcache.kit.doubts``: ``--release``), one runner for
every release kvcache has a drop-in for."""

from __future__ import annotations

import pytest

from kvcache.kit import conformance, doubts
from kvcache.kit.driver import FAMILIES


def test_a_release_without_a_profile_is_named_with_the_ones_there_are() -> None:
    assert conformance.target("0.33.0").label == "conformance-0.33"
    assert conformance.target("0.33.0").drop_in == "kvcache.vllm_0_33"
    with pytest.raises(ValueError, match=r"release='0\.29\.0'.*choose from 0\.33\.0"):
        conformance.target("0.29.0")
    with pytest.raises(ValueError, match=r"release='0\.29\.0'"):
        doubts.drop_in_module("0.29.0")


def test_cli_refuses_a_bad_release_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert conformance.main(["--release", "0.29.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--release" in err and "'0.29.0'" in err
    assert doubts.main(["--release", "9.9.9"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'9.9.9'" in err
    assert doubts.main(["gpu"]) == 2
    assert "side='gpu'" in capsys.readouterr().err


def test_the_release_target_lists_what_it_cannot_build() -> None:
    not_in = conformance.TARGETS["0.33.0"].not_in
    assert not_in == {name: not_in[name] for name, f in FAMILIES.items() if "tq" in f.kinds}
    assert not_in  # the tq family
    run = {f.name for f in conformance.conformant_families(release="0.33.0")}
    assert run == set(FAMILIES) - set(not_in)
    assert conformance.under_release(FAMILIES["full-dcp"]).cp_geometry == "0.33.0"


def test_doubts_read_the_release_section() -> None:
    assert doubts.section_heading("0.33.0") == doubts.SECTION
    _, found = doubts.examples(release="0.33.0")
    assert found and all(set(e.claims) == {"vllm", "kvcache"} for e in found)
    assert doubts.check(["kvcache"], release="0.33.0") == []
    with pytest.raises(ValueError, match=r"no section '## vLLM 0\.34\.0"):
        doubts.examples(release="0.34.0")
