"""The attention registry: names (swin through its entry point), typed per-variant options."""
import subprocess
import sys

import pytest

from megaslide.attention import build_attention, known_attention
from megaslide.attention.dsa.module import DSAOptions


def test_unknown_name_lists_every_variant_including_the_entry_point():
    assert {"dense", "swin", "dsa", "dsa_zero"} <= set(known_attention())
    with pytest.raises(ValueError, match=r"'flash3' is unknown; known: \['dense', 'dsa', 'dsa_zero', 'swin'"):
        build_attention("flash3", 64, 4)


def test_swin_loads_through_its_entry_point_and_the_core_never_imports_baselines():
    code = ("import sys\n"
            "import megaslide.config, megaslide.models.dit, megaslide.perf.flops\n"
            "from megaslide.attention import build_attention\n"
            "assert 'baselines' not in sys.modules, 'the core imported baselines'\n"
            "attn = build_attention('swin', 64, 4, window=(1, 2, 2))\n"
            "assert type(attn).__module__ == 'baselines.swin_attention' and attn.options.window == (1, 2, 2)\n")
    subprocess.run([sys.executable, "-c", code], check=True)


DSA_OPTIONS = r"\['kernel_size', 'max_offset', 'backend', 'halo_reach', 'halo_kernel'\]"


@pytest.mark.parametrize("name,option,known", [("swin", "windw", r"\['window'\]"), ("dsa", "kernel", DSA_OPTIONS),
                                               ("dsa_zero", "window", DSA_OPTIONS)])
def test_an_option_the_variant_does_not_take_names_it_the_variant_and_the_known_ones(name, option, known):
    message = rf"\['{option}'\] unknown to the '{name}' attention, which takes only {known}"
    with pytest.raises(ValueError, match=message):
        build_attention(name, 64, 4, **{option: 3})


def test_dense_takes_no_options():
    with pytest.raises(ValueError, match=r"\['window'\] unknown to the 'dense' attention, which takes no options"):
        build_attention("dense", 64, 4, window=(2, 4, 4))


@pytest.mark.parametrize("options,message", [
    ({"kernel_size": (3, 2, 3)}, r"attention.kernel_size=\(3, 2, 3\) must be"),
    ({"kernel_size": (3, 3)}, "attention.kernel_size"),
    ({"max_offset": -1.0}, r"attention.max_offset=-1.0 must be >= 0"),
    ({"backend": "cuda"}, r"attention.backend='cuda': choose one of \['auto'")])
def test_dsa_option_values_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        DSAOptions(**options)


def test_swin_window_must_be_positive():
    with pytest.raises(ValueError, match=r"attention.window=\(0, 4, 4\) must be three positive ints"):
        build_attention("swin", 64, 4, window=(0, 4, 4))


def test_options_reach_the_module_typed():
    attn = build_attention("dsa", 64, 4, kernel_size=[3, 1, 5], max_offset=2, backend="reference")
    assert attn.options == DSAOptions((3, 1, 5), 2.0, "reference")
    assert attn.offset_proj.out_features == 4 * 15 * 3
