import mlx.core as mx
import pytest
from helpers import BASE, GEMMA4, HYBRIDS

from mlxkv.models import load
from mlxkv.models.random_model import make_checkpoint
from mlxkv.models.structure import LayerRoles, decoder_layers, layer_roles, pads_exactly, state_shapes, text_model
from mlxkv.models.tiny_configs import tiny_config


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    def get(name):
        shape = {**BASE, **(GEMMA4 if name == "gemma4_text" else HYBRIDS[name])}
        model, _ = load(str(make_checkpoint(tmp_path_factory.mktemp(name), name, shape=shape)))
        return text_model(model)

    return get


def test_roles_come_from_mlx_lms_caches_or_nemotrons_block_types(hybrid):
    assert layer_roles(hybrid("qwen3_5")) == LayerRoles((1, 3), (0, 2))  # every second layer attends
    assert layer_roles(hybrid("lfm2")) == LayerRoles((1, 3), (0, 2))  # full_attn_idxs
    assert layer_roles(hybrid("nemotron_h")) == LayerRoles((1, 4), (0, 3))  # M * - M * -: MLP blocks have neither


def test_gemma4s_last_layers_share_the_kv_of_the_last_earlier_layer_of_their_type(hybrid):
    # sliding, sliding, global, sliding | sliding, global: layer 4 reads layer 3's pages, layer 5 layer 2's
    assert layer_roles(hybrid("gemma4_text")) == LayerRoles((0, 1, 2, 3), (), ((4, 3), (5, 2)))


def test_a_qwen3_5_layer_keeps_a_convolution_tail_and_a_float32_delta_state(hybrid):
    model = hybrid("qwen3_5")
    conv, delta = state_shapes(model, layer_roles(model))[0]
    assert conv.shape == (3, 2 * 2 * 32 + 4 * 32) and conv.dtype == mx.float32  # the weights' dtype
    assert delta.shape == (4, 32, 32) and delta.dtype == mx.float32  # value heads, value dim, key dim


@pytest.mark.parametrize(
    ("name", "exact"), [("qwen3_5", True), ("lfm2", True), ("granitemoehybrid", True), ("nemotron_h", False)]
)
def test_padding_is_exact_except_for_nemotron_hs_mamba_state(hybrid, name, exact):
    model = hybrid(name)
    assert pads_exactly(model, layer_roles(model)) is exact


@pytest.mark.parametrize(("name", "exact"), [("mamba", False), ("jamba", False), ("mamba2", True)])
def test_mamba_modules_called_without_a_mask_see_padding_as_tokens(tmp_path, name, exact):
    """Mamba's and Jamba's mixers take `(x, cache)`: called without a mask, a padded row's state runs
    on over its padding, so their prefill chunks run one by one; Mamba 2's honours the mask."""
    config = tiny_config(name)
    model = text_model(load(str(make_checkpoint(tmp_path, config.pop("model_type"), shape=config)))[0])
    assert pads_exactly(model, layer_roles(model)) is exact


def test_an_rwkv7_layer_runs_whole_as_its_two_mixings_share_one_state(tmp_path):
    config = tiny_config("rwkv7")
    model = text_model(load(str(make_checkpoint(tmp_path, config.pop("model_type"), shape=config)))[0])
    roles = layer_roles(model)
    assert roles == LayerRoles((), (0, 1)) and LayerRoles.recurrent_module(decoder_layers(model)[0]) is None
    hidden = model.args.hidden_size
    shift, state, channel_shift = state_shapes(model, roles)[1]  # token shift, WKV state per head, channel shift
    assert (shift.shape, state.shape[0] * state.shape[1], channel_shift.shape) == ((1, hidden), hidden, (1, hidden))
    assert not pads_exactly(model, roles)  # its token shift keeps a padded row's last place
