"""ropekit.integrations.hf_kernels, and hf.patch's kernels door: ropekit through transformers' own door.

transformers >= 5.25 makes apply_rotary_pos_emb a kernels function module; these tests build tiny models
from configs (nothing is downloaded) and drive them through ``kernels.kernelize`` with ropekit's mapping.
"""

import sys
import warnings

import pytest
import torch
import transformers
from torch import nn

from ropekit.integrations import hf, hf_kernels, hf_probe

kernels = pytest.importorskip("kernels")
KERNELIZED = transformers.utils.import_utils.is_kernels_available()
# transformers uses kernels only within its supported range (5.24: kernels < 0.19; 5.25: >= 0.19.1), and
# keeps plain functions otherwise, which hf.patch reaches through the module globals (test_hf.py).
kernelized = pytest.mark.skipif(
    not KERNELIZED,
    reason=f"transformers {transformers.__version__} does not use kernels {kernels.__version__}",
)

VOCAB, SEQ = 128, 20


def llama(seed=0):
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def ids(seq=SEQ):
    return torch.randint(3, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


def kernelize(model, mode=None, **mapping):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kernels.use_kernel_mapping(hf_kernels.kernel_mapping(**mapping)):
            return kernels.kernelize(model, mode=mode or kernels.Mode.INFERENCE, device="cpu")


def hf_function(model):
    held = sys.modules[type(model).__module__].apply_rotary_pos_emb
    return hf_probe.model_function(held)


def forbid(monkeypatch, fn):
    def fail(*args, **kwargs):
        raise AssertionError("the model's own rotation function ran")

    monkeypatch.setattr(fn, "__code__", fail.__code__)


@kernelized
def test_transformers_kernelizes_its_rope_function():
    """The premise: if a release stops doing this, the kernels door is moot and this says so first."""
    model = llama()
    door = model.model.layers[0].self_attn.__dict__["_kernel_funcs"]["rotary_pos_emb"]
    assert hf_probe.kernel_function(door) is hf_function(model)


@kernelized
def test_kernelize_with_ropekits_mapping_equals_unpatched_and_ropekit_rotates(monkeypatch):
    model = llama()
    x = ids()
    with torch.no_grad():
        want = model(x).logits
        kernelize(model)
        first = model(x).logits  # the proof's call: the model's own function answers it
        forbid(monkeypatch, hf_function(model))
        got = model(x).logits  # proved: ropekit alone
        shorter = model(x[:, :7]).logits  # another length is the same form: no new proof
    torch.testing.assert_close(first, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(shorter, want[:, :7], atol=1e-5, rtol=0)


@kernelized
def test_kernelized_training_gradients_equal_unpatched():
    model, reference = llama(), llama()
    x = ids()
    kernelize(model, mode=kernels.Mode.TRAINING)
    with torch.no_grad():
        model(x)  # the proof runs under no_grad on the first call of the form
    for m in (model, reference):
        m.train()
        m(x).logits.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


@kernels.use_kernel_forward_from_hub("rotary_pos_emb")
def mirror_rotary(q, k, cos, sin, unsqueeze_dim=1):
    """A rotation no ropekit convention reproduces: the pairs are (i, D - 1 - i)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)

    def rotate(x):
        return torch.cat((-x.flip(-1)[..., : x.shape[-1] // 2], x.flip(-1)[..., x.shape[-1] // 2 :]), dim=-1)

    return tuple(x * cos + rotate(x) * sin for x in (q, k))


@kernels.use_kernelized_func(mirror_rotary)
class MirrorAttention(nn.Module):
    def forward(self, q, k, cos, sin):
        return mirror_rotary(q, k, cos, sin)


def test_a_function_ropekit_does_not_reproduce_keeps_its_own_code_with_a_warning():
    layer = MirrorAttention()
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    angles = torch.arange(5.0)[:, None] * torch.tensor([1.0, 0.1, 0.01, 0.001])
    cos, sin = torch.cat((angles, angles), -1).cos()[None], torch.cat((angles, angles), -1).sin()[None]
    want = hf_probe.kernel_function(mirror_rotary)(q, k, cos, sin)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with kernels.use_kernel_mapping(hf_kernels.kernel_mapping()):
            kernels.kernelize(layer, mode=kernels.Mode.INFERENCE, device="cpu")
    with pytest.warns(UserWarning, match="no ropekit convention reproduces it"):
        got = layer(q, k, cos, sin)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


@kernelized
def test_patch_through_the_kernels_door_equals_the_generic_patch_and_unpatched(monkeypatch):
    x = ids()
    model = llama()
    with torch.no_grad():
        want = model(x).logits
        assert hf.patch(model) == 2
        assert hf.patch_doors(model) == {"kernels"}
        assert not any("forward" in m.__dict__ for m in model.model.layers)  # no layer forward copied
        through_kernels = model(x).logits
        hf.unpatch(model)
        monkeypatch.setattr(hf, "_kernel_door", lambda layer, fn: None)  # the generic patch only
        assert hf.patch(model) == 2
        assert hf.patch_doors(model) == {"globals"}
        through_globals = model(x).logits
    torch.testing.assert_close(through_kernels, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(through_globals, through_kernels, atol=1e-6, rtol=0)


@kernelized
def test_unpatch_gives_back_the_kernel_kernelize_installed():
    model = kernelize(llama())
    door = model.model.layers[0].self_attn.__dict__["_kernel_funcs"]["rotary_pos_emb"]
    installed = door.__dict__["forward"]
    hf.patch(model)
    assert door.__dict__["forward"] is not installed
    assert "through kernels" in next(iter(hf.patched_layers(model).values()))["apply_rotary_pos_emb"]
    hf.unpatch(model)
    assert door.__dict__["forward"] is installed
    hf.unpatch(llama())  # nothing patched: nothing to give back


def test_the_mapping_names_ropekit_for_every_device_and_refuses_what_kernels_would_not_map():
    mapping = hf_kernels.kernel_mapping(backend="torch", devices=("cpu", "cuda"))
    assert set(mapping) == set(hf_kernels.ROTARY_LAYER_NAMES)
    repository = mapping["rotary_pos_emb"]["cuda"]
    assert repository == hf_kernels.RotaryRepository("torch")
    assert repository.load() is hf_kernels.rotary_layer("torch")
    with pytest.raises(ValueError, match=r"backend: expected 'auto' or one of .* got 'cuda'"):
        hf_kernels.kernel_mapping(backend="cuda")
    with pytest.raises(ValueError, match=r"devices: expected a non-empty tuple .* got 'cpu'"):
        hf_kernels.kernel_mapping(devices="cpu")
    with pytest.raises(ValueError, match=r"devices: .* got \('cpu', 'tpu9'\)"):
        hf_kernels.kernel_mapping(devices=("cpu", "tpu9"))
    with pytest.raises(ValueError, match="backend"):
        hf_kernels.RotaryRepository("nope")


def test_the_layer_refuses_a_module_that_is_not_a_kernels_function():
    layer = hf_kernels.rotary_layer()()
    with pytest.raises(ValueError, match="module: ropekit's kernels layer serves kernels function modules"):
        layer(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1))
