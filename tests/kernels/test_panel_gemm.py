"""kernels/panel_gemm.py: the project's decode matmul, built with this machine's C compiler, against
F.linear at the row counts and shapes a step gives it (panels cut short, blocks of rows split unevenly,
a bias), and its refusal of what would read past a buffer. CPU-only: it runs where x86-64 has AVX2 and
FMA and a C compiler is installed, as on CI's machine; elsewhere it skips, and the model's tests use oneDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpilot.kernels import panel_gemm

pytestmark = pytest.mark.skipif(
    not panel_gemm.available(), reason="no x86-64 CPU with AVX2 and FMA, or no C compiler"
)


@pytest.mark.parametrize("out_features, in_features", [(96, 40), (100, 37), (5, 3), (3072, 576)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 13, 64])
def test_the_panel_kernel_multiplies_as_f_linear(out_features: int, in_features: int, rows: int) -> None:
    torch.manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, in_features)
    wider = torch.cat([x, torch.randn(rows, 3)], dim=1)
    panels = panel_gemm.pack(weight)
    assert panels.shape == (-(-out_features // panel_gemm.PANEL), in_features, panel_gemm.PANEL)
    for got, want in (
        (panel_gemm.multiply(x, panels, out_features), F.linear(x, weight)),
        (panel_gemm.multiply(x, panels, out_features, bias), F.linear(x, weight, bias)),
        # inputs that are views, not contiguous (a column-major copy, the first columns of a wider batch),
        # are made contiguous first
        (panel_gemm.multiply(x.t().contiguous().t(), panels, out_features), F.linear(x, weight)),
        (panel_gemm.multiply(wider[:, :in_features], panels, out_features), F.linear(x, weight)),
    ):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_panels_are_the_weight_permuted() -> None:
    """What `pack` lays out holds the weight's values and zeros only: nothing is lost or rounded."""
    weight = torch.randn(20, 7)
    panels = panel_gemm.pack(weight)
    assert torch.equal(panels.transpose(1, 2).reshape(-1, 7)[:20], weight)
    assert not panels.transpose(1, 2).reshape(-1, 7)[20:].any()


@pytest.mark.parametrize("out_features", [48, 50])  # a multiple of the panel, and a padded last panel
def test_the_weight_is_read_back_written_in_place_and_looked_up_from_its_panels(out_features: int) -> None:
    """What lets the panels replace a weight: read back exactly, new values laid out in the same storage,
    and an embedding table's rows looked up where the panels hold a tied one."""
    weight = torch.randn(out_features, 24)
    panels = panel_gemm.pack(weight)
    assert torch.equal(panel_gemm.unpack(panels, out_features), weight)
    new = torch.randn(out_features, 24)
    storage = panels.data_ptr()
    panel_gemm.pack_into(panels, new)
    assert panels.data_ptr() == storage and torch.equal(panels, panel_gemm.pack(new))
    index = torch.tensor([0, 17, out_features - 1, 3, 17])
    assert torch.equal(panel_gemm.rows(panels, index), new[index])
    with pytest.raises(ValueError, match="not the shape"):
        panel_gemm.pack_into(panels, torch.zeros(out_features, 25))
    with pytest.raises(ValueError, match="not the shape"):
        panel_gemm.pack_into(panels, torch.zeros(out_features + 16, 24))


PANELS_96_40 = panel_gemm.pack(torch.zeros(96, 40))


@pytest.mark.parametrize(
    "x, panels, out_features, bias",
    [
        (torch.zeros(2, 41), PANELS_96_40, 96, None),  # an input wider than the weight
        (torch.zeros(2, 40, dtype=torch.float64), PANELS_96_40, 96, None),  # not float32
        (torch.zeros(2, 40), PANELS_96_40, 97, None),  # more outputs than the panels hold
        (torch.zeros(2, 40), PANELS_96_40, 0, None),
        (torch.zeros(2, 40), PANELS_96_40, 96, torch.zeros(95)),  # a bias of another size
        (torch.zeros(2, 40), PANELS_96_40.half(), 96, None),  # panels of another dtype
        (torch.zeros(2, 40), torch.zeros(96, 40), 96, None),  # a weight that was never packed
        (torch.zeros(2, 40), PANELS_96_40.transpose(0, 1).contiguous().transpose(0, 1), 96, None),
        (torch.zeros(40), PANELS_96_40, 96, None),  # not [rows, in]
    ],
)
def test_inputs_that_do_not_fit_the_panels_are_refused(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> None:
    with pytest.raises(ValueError, match="panel_gemm"):
        panel_gemm.multiply(x, panels, out_features, bias)
