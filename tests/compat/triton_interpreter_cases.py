"""A subset of the compat cases run on the Triton kernel through Triton's CPU interpreter.

Run only by test_triton_interpreter.py, in a subprocess with TRITON_INTERPRET=1 (Triton reads it when the
kernel module is imported). The interpreter costs about half a second per call, so each peer contributes its
characteristic cases: the test bodies are the ones in test_<peer>.py, called with the Triton backend forced.
"""

from __future__ import annotations

import pytest
import torch

from ropekit.backends.triton.rotary import interpreter_enabled

from . import test_flash_attn as flash_attn_cases
from . import test_hf as hf_cases
from . import test_liger as liger_cases
from . import test_megatron as megatron_cases
from . import test_torchtune as torchtune_cases
from . import test_vllm as vllm_cases
from .conftest import force_backend

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (see the runner)")


@pytest.fixture
def triton(monkeypatch):
    return force_backend(monkeypatch, "triton")


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_flash_attn_apply_rotary_emb(triton, inplace, interleaved):
    flash_attn_cases.test_rotary_emb_matches_reference_and_its_gradient_is_the_inverse_rotation(
        triton, inplace, interleaved, 0.5, "tensor", torch.bfloat16
    )


@pytest.mark.parametrize("gqa", [False, True])
def test_flash_attn_qkv_in_place(triton, gqa):
    flash_attn_cases.test_rotary_emb_qkv_rotates_q_and_k_in_place_and_trains(
        triton, False, 1.0, "int", gqa, torch.float16
    )


def test_flash_attn_kv_in_place(triton):
    flash_attn_cases.test_rotary_emb_kv_rotates_only_k_in_place_and_trains(
        triton, True, 0.5, "zero", torch.float16
    )


def test_flash_attn_varlen(triton):
    flash_attn_cases.test_rotary_emb_varlen_equals_the_padded_batch(
        triton, True, False, 1.0, "tensor", torch.bfloat16
    )


def test_flash_attn_packed_qkv_trains(triton):
    flash_attn_cases.test_packed_qkv_in_place_trains_like_the_out_of_place_rotation(triton)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hf_against_transformers(triton, dtype):
    atol, rtol = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-1, 1e-5)}[dtype]
    hf_cases.test_outputs_and_gradients_match_transformers(triton, 2, 9, 4, 2, 16, dtype, atol, rtol, False)


def test_liger_against_transformers(triton):
    liger_cases.test_correctness_against_transformers(triton, 2, 9, 4, 2, 16, torch.float32, 1e-5, 1e-5, True)


@pytest.mark.parametrize("is_neox_style", [True, False])
def test_vllm_in_place_on_a_padded_view(triton, is_neox_style):
    vllm_cases.test_rotary_embedding_forward_is_the_reference_rotation_in_place(
        triton, is_neox_style, vllm_cases.padded_shape, 64, 32, torch.bfloat16, True
    )


def test_torchtune_pairs(triton, assert_matches_reference):
    torchtune_cases.test_rotates_interleaved_pairs_by_meta_frequencies(
        triton, assert_matches_reference, True, "per_sample"
    )


def test_megatron_sbhd(triton, assert_matches_reference):
    megatron_cases.test_packed_qkv_slices_rotate_as_the_reference(
        triton, assert_matches_reference, torch.float32, True, 0.5, True, 1.25
    )


def test_flash_attn_module_packed_qkv(triton):
    flash_attn_cases.test_module_rotates_packed_qkv_in_place_as_flash_attn(triton, True, 0.5, 17)


def test_liger_vision_table(triton):
    liger_cases.test_vision_2d_cos_sin(triton, 9, 3, 16, torch.float32, 1e-5, 1e-5)


def test_liger_rope_function(triton):
    liger_cases.test_functional_correctness(triton, 2, 5, 3, 3, 16, 2)


def test_torchtune_vision(triton, assert_matches_reference):
    torchtune_cases.test_vision_turns_x_then_y_pairs_by_patch_column_and_row_plus_one(
        assert_matches_reference, True
    )


def test_vllm_op_in_place_bumps_versions(triton):
    vllm_cases.test_in_place_rotation_bumps_version_so_autograd_catches_the_overwrite("triton", True)


def test_vllm_variants_fope_and_multiaxis_on_triton(triton):
    from . import test_vllm_variants as variant_cases

    variant_cases.test_fope_matches_reference(3, "triton")  # one table row per (position, kv head)
    bailing = {"rope_type": "bailing_mrope", "mrope_section": [2, 3, 3], "rope_theta": 1000.0}
    variant_cases.test_multiaxis_variants_match_reference(bailing, "bailing", False, "triton")  # token rows
