"""The CPU shims: pinned megatron-core version and site inventory, and what each redirection does."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.compat import cpu

SHIMS_OFF = "the CPU shims are a no-op with CUDA (a GPU machine runs the CUDA paths they stand in for)"


def test_megatron_version_is_the_audited_one():
    cpu.check_megatron_version()  # raises with the upgrade procedure otherwise
    assert cpu.megatron_core_version() == cpu.CHECKED_MEGATRON_CORE_VERSION


def test_cuda_site_inventory_is_unchanged():
    """Fails loudly when an upgrade adds/removes GPU-assuming sites the shims were audited for."""
    scanned = cpu.scan_cuda_sites()
    changed = {k: (scanned.get(k), v) for k, v in cpu.PINNED_SITE_COUNTS.items() if scanned.get(k) != v}
    assert not changed, (f"megatron-core CUDA sites changed (file: (found, pinned), order "
                         f"{list(cpu.SITE_PATTERNS)}): {changed}; "
                         "re-audit megatron_dapo/compat/cpu.py SHIMS and PINNED_SITE_COUNTS")


def test_every_shim_names_an_existing_file():
    root = cpu.megatron_core_root()
    for shim in cpu.SHIMS:
        for site in shim.files:
            assert (root / site.split(":")[0]).is_file(), site


@pytest.mark.skipif(torch.cuda.is_available(), reason=SHIMS_OFF)
@pytest.mark.designed_skip(SHIMS_OFF)
def test_install_redirects_cuda_to_cpu():
    assert cpu.install() is True
    assert cpu.install() is True  # idempotent
    assert cpu.is_installed()
    assert torch.cuda.current_device() == "cpu"
    torch.cuda.synchronize()  # no-op instead of "Torch not compiled with CUDA"
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.tensor([1.0], device=torch.device("cuda", 0)).device.type == "cpu"
    x = torch.ones(3)
    assert x.cuda() is x
    assert x.to("cuda").device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"  # what megatron's fp32 checks compare against
    assert x.type(torch.float64).dtype == torch.float64  # the conversion form is untouched


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason=SHIMS_OFF)
@pytest.mark.designed_skip(SHIMS_OFF)
def test_uneven_first_dim_gather_on_gloo(tmp_path):
    """The alltoall dispatcher's expert-TP all-gather of uneven splits (and its backward's reduce-scatter) on 2 gloo
    ranks: exact through the shim; megatron's own gather is refused by gloo (why the shim exists)."""
    import json

    from tests.torchrun import REPO, run_torchrun

    run_torchrun(REPO / "tests/dist/compat_uneven.py", str(tmp_path / "out.json"))
    for rank in json.loads((tmp_path / "out.json").read_text()):
        assert rank["gather_shimmed"] and rank["reduce_scatter_unshimmed"]
        assert rank["gather_exact"] and rank["reduce_scatter_exact"] and rank["backward_exact"]
        assert "invalid tensor size" in rank["unshimmed_gather_error"], rank["unshimmed_gather_error"]
