"""Checkpoint loading: layouts, and bad checkpoints that must fail with an error naming the problem."""

import json
import os
import shutil

import numpy as np
import pytest
from support import CONFIG_A, REPO, SHIPPED
from safetensors.numpy import load_file, save_file

from slope_jax import load_checkpoint
from slope_jax.checkpoints import writer as checkpoint_writer
from slope_jax.checkpoints.hf import CheckpointError, open_checkpoint
from slope_jax.model import gpt_oss as model
from slope_jax.model.config import ConfigError, ModelConfig


@pytest.fixture()
def ckpt(tmp_path):
    """A fresh single-file MXFP4 checkpoint of CONFIG_A that a test may damage."""
    d = str(tmp_path / "ck")
    checkpoint_writer.write_hf(d, CONFIG_A, checkpoint_writer.random_params(CONFIG_A, 1))
    return d


def _rewrite(path, fn):
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def test_loaded_params_match_declaration(checkpoints):
    cfg, params = load_checkpoint(checkpoints["A"]["mxfp4"], "float32", progress=False)
    specs = model.param_specs(cfg, "float32")
    flat_p = {k: v for k, v in _flat(params)}
    flat_s = {k: v for k, v in _flat(specs, leaf=model.ParamSpec)}
    assert flat_p.keys() == flat_s.keys()
    for k, s in flat_s.items():
        assert flat_p[k].shape == s.shape and flat_p[k].dtype == s.dtype, k


def _flat(tree, prefix="", leaf=None):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, prefix + k + "/", leaf)
        else:
            yield prefix + k, v


def test_sharded_and_single_file_and_original_load_identically(checkpoints, tmp_path):
    params_np = checkpoints["A"]["params"]
    single = str(tmp_path / "single")
    checkpoint_writer.write_hf(single, CONFIG_A, params_np)
    a = load_checkpoint(checkpoints["A"]["mxfp4"], "bfloat16", progress=False)[1]
    b = load_checkpoint(single, "bfloat16", progress=False)[1]
    c = load_checkpoint(os.path.join(checkpoints["A"]["mxfp4"], "original"), "bfloat16", progress=False)[1]
    for (k, x), (_, y), (_, z) in zip(_flat(a), _flat(b), _flat(c)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=k)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(z), err_msg=k)
    np.testing.assert_array_equal(np.asarray(a["layers"]["w1_blocks"]), params_np["layers"]["w1_blocks"])


def test_shipped_checkpoint_is_released_layout():
    ck = open_checkpoint(SHIPPED)
    assert ck.layout == "hf" and ck.config.expert_format == "mxfp4"
    assert os.path.exists(os.path.join(SHIPPED, "tokenizer.json"))
    assert len(ck.source.header) == 19 * ck.config.num_hidden_layers + 3  # docs/model.md §3.1: 19 tensors a layer + 3


def test_missing_tensor(ckpt):
    f = os.path.join(ckpt, "model.safetensors")
    _rewrite(f, lambda t: t.pop("model.layers.2.self_attn.sinks"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.2\.self_attn\.sinks"):
        open_checkpoint(ckpt)


def test_wrong_shape_names_file_tensor_expected_and_found(ckpt):
    f = os.path.join(ckpt, "model.safetensors")
    _rewrite(f, lambda t: t.__setitem__("model.layers.1.self_attn.k_proj.weight",
                                        np.zeros((40, 64), dtype=t["model.embed_tokens.weight"].dtype)))
    with pytest.raises(CheckpointError) as e:
        open_checkpoint(ckpt)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.layers.1.self_attn.k_proj.weight" in msg
    assert "[40, 64]" in msg and "[48, 64]" in msg and "num_key_value_heads*head_dim" in msg


def test_truncated_file(ckpt):
    f = os.path.join(ckpt, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 1000)
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        open_checkpoint(ckpt)


def test_config_contradicting_tensors(ckpt):
    p = os.path.join(ckpt, "config.json")
    with open(p) as fh:
        d = json.load(fh)
    d["intermediate_size"] = 128  # tensors were written for 96
    with open(p, "w") as fh:
        json.dump(d, fh)
    want = (r"gate_up_proj_bias' has shape \[6, 192\], expected \[6, 256\] = "
            r"\[6 \(num_experts\), 256 \(2\*intermediate_size\)\] from .*config\.json")
    with pytest.raises(CheckpointError, match=want):
        open_checkpoint(ckpt)


def test_config_layer_count_contradicting_tensors(ckpt):
    p = os.path.join(ckpt, "config.json")
    with open(p) as fh:
        d = json.load(fh)
    d["num_hidden_layers"] = 3
    d["layer_types"] = d["layer_types"][:3]
    with open(p, "w") as fh:
        json.dump(d, fh)
    with pytest.raises(CheckpointError, match=r"unknown tensor.*model\.layers\.3\.") as e:
        open_checkpoint(ckpt)
    assert "beyond num_hidden_layers" in str(e.value)


def test_dense_tensors_under_mxfp4_config(tmp_path):
    d = str(tmp_path / "dense")
    checkpoint_writer.write_hf(d, CONFIG_A, checkpoint_writer.random_params(CONFIG_A, 1), experts="dense")
    p = os.path.join(d, "config.json")
    with open(p) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    with open(p, "w") as fh:
        json.dump(cfg, fh)
    with pytest.raises(CheckpointError, match="declares mxfp4 but the tensors hold unquantized"):
        open_checkpoint(d)


def test_duplicate_tensor_across_shards(tmp_path):
    d = str(tmp_path / "sharded")
    checkpoint_writer.write_hf(d, CONFIG_A, checkpoint_writer.random_params(CONFIG_A, 1), num_shards=2)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    first = load_file(os.path.join(d, files[0]))
    name = next(iter(first))
    _rewrite(os.path.join(d, files[1]), lambda t: t.__setitem__(name, first[name]))
    with pytest.raises(CheckpointError, match=f"{name}.*appears twice"):
        open_checkpoint(d)


def test_wrong_dtype(ckpt):
    f = os.path.join(ckpt, "model.safetensors")
    _rewrite(f, lambda t: t.__setitem__("model.layers.0.mlp.experts.down_proj_scales",
                                        t["model.layers.0.mlp.experts.down_proj_scales"].astype(np.float32)))
    with pytest.raises(CheckpointError, match=r"down_proj_scales.*dtype F32.*U8"):
        open_checkpoint(ckpt)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        open_checkpoint(tmp_path / "empty")


def test_index_pointing_to_missing_shard(tmp_path):
    d = str(tmp_path / "sharded")
    checkpoint_writer.write_hf(d, CONFIG_A, checkpoint_writer.random_params(CONFIG_A, 1), num_shards=2)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    os.remove(os.path.join(d, files[1]))
    with pytest.raises(CheckpointError, match=f"{files[1]}.*does not exist"):
        open_checkpoint(d)


# ------------------------------------------------------------------------------------------------ configs
def test_released_configs_parameter_counts():
    """Counts from the declared shapes match the model card (docs/model.md §1): 20.915 B / 116.83 B total."""
    for name, total in (("gpt-oss-20b", 20.915e9), ("gpt-oss-120b", 116.83e9)):
        cfg = ModelConfig.from_json(os.path.join(os.path.dirname(SHIPPED), "..", "configs", f"{name}.json"))
        n = 0
        for _, s in _flat(model.param_specs(cfg), leaf=model.ParamSpec):
            count = int(np.prod(s.shape))
            n += count * 2 if s.axes[-1] == "block_bytes" else (0 if s.axes[-1].endswith("_blocks") else count)
        assert abs(n - total) / total < 1e-3, (name, n)
        assert cfg.sliding_layers == tuple(range(0, cfg.num_hidden_layers, 2))


def test_original_config_maps_rope_keys(tmp_path):
    d = CONFIG_A.to_original_dict()
    d["rope_ntk_beta"], d["rope_ntk_alpha"], d["initial_context_length"] = 16.0, 2.0, 2048
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    c = ModelConfig.from_json(p)
    assert (c.rope_beta_fast, c.rope_beta_slow, c.rope_original_max_position_embeddings) == (16.0, 2.0, 2048)
    assert c.rope_truncate is False and c.expert_format == "mxfp4"
    # an original config without rope_scaling_factor is YaRN with factor 32, as OpenAI's reference ModelConfig
    # defaults it (docs/model.md §1), not unscaled RoPE
    del d["rope_scaling_factor"]
    p.write_text(json.dumps(d))
    c = ModelConfig.from_json(p)
    assert (c.rope_type, c.rope_scaling_factor, c.max_position_embeddings) == ("yarn", 32.0, 2048 * 32)


def test_hf_rope_parameters_key_is_read():
    d = CONFIG_A.to_hf_dict()
    rope = d.pop("rope_scaling")
    d["rope_parameters"] = dict(rope, rope_theta=99999.0, factor=16.0)
    d.pop("rope_theta")
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 99999.0 and c.rope_scaling_factor == 16.0


@pytest.mark.parametrize("field,value,message", [
    ("num_key_value_heads", 3, "num_attention_heads=16 must be divisible by num_key_value_heads=3"),
    ("head_dim", 11, "head_dim=11 must be even"),
    ("layer_types", ["sliding_attention"] * 3, "layer_types has 3 entries, num_hidden_layers=4"),
    ("num_experts_per_tok", 9, "experts_per_token=9 exceeds num_experts=6"),
    ("hidden_size", 72, "hidden_size=72 must be a multiple of 32"),
    ("vocab_size", 0, "vocab_size=0: must be a positive integer"),
    ("attention_bias", False, "attention_bias=False"),
    ("swiglu_limit", None, "swiglu_limit=None must be a number"),  # a float() TypeError that named no field
    ("rms_norm_eps", "1e-5", "rms_norm_eps='1e-5' must be a number"),
    ("max_position_embeddings", 4096.5, "max_position_embeddings=4096.5 must be an integer"),
    ("rope_scaling", {"rope_type": "yarn", "beta_fast": 32.0}, "rope factor is required"),  # transformers refuses
])
def test_config_validation_names_the_field(field, value, message):
    d = CONFIG_A.to_hf_dict()
    d[field] = value
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ModelConfig.from_hf_dict(d)


def test_optional_fields_default_as_transformers_reads_them():
    """A config.json without `head_dim` or `sliding_window` means what transformers' GptOssConfig (and so vLLM) makes
    of it: 64 and 128, not hidden_size / num_attention_heads (a 2880-wide model with 64 heads would get 45)."""
    from transformers import GptOssConfig

    d = CONFIG_A.to_hf_dict()
    del d["head_dim"], d["sliding_window"]
    ours, ref = ModelConfig.from_hf_dict(d), GptOssConfig(**d)
    assert (ours.head_dim, ours.sliding_window) == (ref.head_dim, ref.sliding_window) == (64, 128)
    d["sliding_window"] = None  # an explicit null: transformers masks its sliding layers without a window
    with pytest.raises(ConfigError, match="sliding_window=null is not supported"):
        ModelConfig.from_hf_dict(d)
    d["layer_types"] = ["full_attention"] * len(d["layer_types"])  # ...unless no layer slides
    assert ModelConfig.from_hf_dict(d).layer_types == ("full_attention",) * len(d["layer_types"])


@pytest.mark.parametrize("key,value", [("attention_factor", 1.5), ("partial_rotary_factor", 0.5), ("mscale", 0.7)])
def test_rope_options_transformers_would_apply_are_refused(key, value):
    d = CONFIG_A.to_hf_dict()
    d["rope_scaling"] = dict(d["rope_scaling"], **{key: value})
    with pytest.raises(ConfigError, match=f"rope {key}={value} is not supported"):
        ModelConfig.from_hf_dict(d)
    d["rope_scaling"][key] = {"partial_rotary_factor": 1.0}.get(key)  # the neutral value reads as before
    assert ModelConfig.from_hf_dict(d) == ModelConfig.from_hf_dict(CONFIG_A.to_hf_dict())


def test_config_missing_field(tmp_path):
    d = CONFIG_A.to_hf_dict()
    del d["hidden_size"]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(d))
    with pytest.raises(ConfigError, match="required field 'hidden_size' is missing"):
        ModelConfig.from_json(p)
    p.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json(p)


def test_copy_of_shipped_checkpoint_loads(tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(SHIPPED, dst)
    cfg, params = load_checkpoint(dst, "bfloat16", progress=False)
    assert cfg.vocab_size == 1024 and params["layers"]["w1_blocks"].dtype == np.uint8


# ---------------------------------------------------------------------------------------------------------------
# orbax fast restart (slope_jax.checkpoints.orbax_store, `python -m slope_jax.convert`)
def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def _assert_same_placed(got: dict, want: dict, where: str):
    """Bitwise-equal values, equal shapes/dtypes, and equivalent shardings, leaf by leaf."""
    fg, fw = dict(_flat(got)), dict(_flat(want))
    assert fg.keys() == fw.keys(), where
    for k, w in fw.items():
        g = fg[k]
        assert g.shape == w.shape and g.dtype == w.dtype, (where, k, g.shape, w.shape, g.dtype, w.dtype)
        assert g.sharding.is_equivalent_to(w.sharding, w.ndim), (where, k, g.sharding, w.sharding)
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{where}: {k}")


def _assert_replicas_share_host_blocks(params: dict, where: str):
    """CPU backend: devices holding the same shard share one 64-byte-aligned host buffer (`checkpoints.host`: one
    block per distinct shard, adopted without a copy); distinct shards have distinct buffers."""
    import jax

    if jax.default_backend() != "cpu":
        return
    for k, a in _flat(params):
        by_index: dict = {}
        for s in a.addressable_shards:
            key = tuple(sl.indices(d)[:2] for sl, d in zip(s.index, a.shape))
            by_index.setdefault(key, set()).add(s.data.unsafe_buffer_pointer())
        assert all(len(p) == 1 for p in by_index.values()), (where, k, "replicas hold copies")
        ptrs = [next(iter(p)) for p in by_index.values()]
        assert len(set(ptrs)) == len(ptrs), (where, k, "distinct shards share a buffer")
        assert all(p % 64 == 0 for p in ptrs), (where, k, "unaligned host block")


@pytest.mark.parametrize("name", ["A", "B"])
def test_orbax_restore_is_bitwise_the_hf_load_in_any_layout(checkpoints, tmp_path, name):
    """Convert at (P, R, U) = (2, 2, 2), restore at the same, (1, 2, 4), (4, 1, 2) (CONFIG_B: 3+2+2+2 layers, padding
    entries inside the stack) and (1, 1, 1): every parameter equals the HF loader's into that layout bit for bit,
    with the same sharding. Also in float32 (a dtype other than the converted one; the cast is exact). Both paths
    keep one host block per distinct shard (replicas share it)."""
    from slope_jax.checkpoints import orbax_store
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve.engine import PrefillEngine

    src, out = checkpoints[name]["mxfp4"], str(tmp_path / "orbax")
    meta = orbax_store.convert(src, out, ParallelConfig(2, 2, 2), "bfloat16", progress=False)
    assert orbax_store.is_orbax_checkpoint(out) and not orbax_store.is_orbax_checkpoint(src)
    assert meta["saved_layout"] == {"pipeline": 2, "ring": 2, "ulysses": 2}
    for par, dtype in ((ParallelConfig(2, 2, 2), "bfloat16"), (ParallelConfig(1, 2, 4), "bfloat16"),
                       (ParallelConfig(4, 1, 2), "bfloat16"), (ParallelConfig(1, 1, 1), "bfloat16"),
                       (ParallelConfig(1, 2, 4), "float32")):
        hf_engine = PrefillEngine.from_checkpoint(src, par, dtype, progress=False)
        orbax_engine = PrefillEngine.from_checkpoint(out, par, dtype, progress=False)  # detects the orbax dir
        want, got = hf_engine.params, orbax_engine.params
        _assert_same_placed(got, want, f"{name} {par} {dtype}")
        _assert_replicas_share_host_blocks(got, f"orbax {name} {par} {dtype}")
        _assert_replicas_share_host_blocks(want, f"hf {name} {par} {dtype}")
        # bitwise the same weights, so the same identity: prefix-cache keys and exports (which vLLM's connector
        # checks against the source checkpoint it serves) name the source's weights
        assert orbax_engine.weights_digest == hf_engine.weights_digest == meta["source_weights_digest"]


def test_a_lossy_conversion_does_not_claim_the_source_weights(checkpoints, tmp_path):
    """A float32 source converted to bfloat16 rounds its weights: the marker records no source weights digest and the
    restored engine names its own parameters; the same source converted to float32 keeps every value and names the
    source's weights (as a bf16 source converted to bf16 does, above)."""
    from safetensors import safe_open

    from slope_jax.atomic import atomic_safetensors
    from slope_jax.checkpoints import digest, orbax_store
    from slope_jax.serve.engine import PrefillEngine

    src = str(tmp_path / "f32")
    shutil.copytree(checkpoints["A"]["dense"], src)
    rng = np.random.default_rng(0)
    for f in (f for f in os.listdir(src) if f.endswith(".safetensors")):
        with safe_open(os.path.join(src, f), "numpy") as h:
            t = {k: h.get_tensor(k) for k in h.keys()}
        t = {k: (v.astype(np.float32) * (1 + 1e-4 * rng.standard_normal(v.shape)).astype(np.float32)
                 if v.dtype != np.uint8 else v) for k, v in t.items()}  # values off the bf16 grid
        atomic_safetensors(os.path.join(src, f), t, {"format": "pt"})
    want = digest.weights_digest(src)
    lossy = orbax_store.convert(src, str(tmp_path / "bf16"), dtype="bfloat16", progress=False)
    exact = orbax_store.convert(src, str(tmp_path / "fp32"), dtype="float32", progress=False)
    assert lossy["source_weights_digest"] is None and exact["source_weights_digest"] == want
    got = PrefillEngine.from_checkpoint(str(tmp_path / "bf16"), dtype="float32", progress=False).weights_digest
    assert got != want and len(got) == 32
    for dtype in ("float32", "bfloat16"):  # what the exact conversion's restore holds is the source's load, bitwise
        restored = PrefillEngine.from_checkpoint(str(tmp_path / "fp32"), dtype=dtype, progress=False)
        loaded = PrefillEngine.from_checkpoint(src, dtype=dtype, progress=False)
        _assert_same_placed(restored.params, loaded.params, f"float32 conversion restored in {dtype}")
        assert restored.weights_digest == loaded.weights_digest == want


def test_convert_cli_and_refusals(tmp_path):
    """The console entry converts the shipped checkpoint (tokenizer copied, marker written last), refuses to overwrite,
    and a restore refuses a directory converted under another declaration, naming the parameter."""
    import subprocess
    import sys

    from slope_jax.checkpoints import orbax_store

    out = str(tmp_path / "tiny-orbax")
    cmd = [sys.executable, "-m", "slope_jax.convert", f"--checkpoint={SHIPPED}", f"--out={out}", "--cpu_devices=4",
           "--pipeline=2", "--ulysses=2"]
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["generation_config.json", "params", orbax_store.MARKER, "tokenizer.json",
                                       "tokenizer_config.json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and "already holds a converted checkpoint" in r.stderr, r.stderr[-2000:]

    from slope_jax.checkpoints import digest

    reads = digest.ReadDigests()
    cfg, params, _ = orbax_store.restore(out, reads=reads)
    want = load_checkpoint(SHIPPED, "bfloat16", progress=False)[1]
    for (k, g), (_, w) in zip(_flat(params), _flat(want)):
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=k)
    # full-content digests of a converted directory: every restored byte is hashed from its host block; a copy
    # reads the same digests, a copy with one stored byte changed differs in exactly the array holding it
    assert reads.nbytes == sum(g.nbytes for _, g in _flat(params))
    import shutil

    copies = {n: shutil.copytree(out, tmp_path / n) for n in ("same", "changed")}
    data = [os.path.join(d, f) for d, _, fs in os.walk(copies["changed"] / "params") for f in fs if "/d" in d]
    big = max(data, key=os.path.getsize)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        byte = f.read(1)[0]
        f.seek(os.path.getsize(big) // 2)
        f.write(bytes([byte ^ 1]))
    got = {}
    for n, path in copies.items():
        got[n] = digest.ReadDigests()
        orbax_store.restore(str(path), reads=got[n])
    assert digest.compare_reads({0: reads.digests, 1: got["same"].digests}) == []
    problems = digest.compare_reads({0: reads.digests, 1: got["changed"].digests})
    assert len(problems) == 1 and "process 0 read" in problems[0] and "process 1 read" in problems[0], problems

    marker = os.path.join(out, orbax_store.MARKER)
    meta = json.load(open(marker))
    meta["params"]["layers/wq"][0][0] += 1  # as if the declaration had changed since the conversion
    json.dump(meta, open(marker, "w"))
    with pytest.raises(CheckpointError, match="different parameter declaration.*layers/wq"):
        orbax_store.restore(out)
    meta["format"] = 99
    json.dump(meta, open(marker, "w"))
    with pytest.raises(CheckpointError, match="format=99"):
        orbax_store.restore(out)
    os.remove(marker)  # an interrupted conversion: not taken for a checkpoint of either kind
    with pytest.raises(CheckpointError):
        load_checkpoint(out, progress=False)


# ---------------------------------------------------------------------------------------------------------------
# one declaration
def test_a_new_declared_parameter_flows_everywhere(monkeypatch, tmp_path):
    """A hypothetical parameter added to the declaration (a subclass of `Layers`) plus its row in each name map (data,
    no code): random init, the writer (HF sharded + original/), the loader and its shape checks, the shardings and
    orbax convert/restore all carry it, with no other edit."""
    from jax.sharding import PartitionSpec as Ps

    from slope_jax.checkpoints import names, orbax_store
    from slope_jax.parallel import sharding
    from slope_jax.parallel.config import ParallelConfig
    from slope_jax.serve.engine import PrefillEngine

    class LayersPlus(model.Layers):
        def __init__(self, cfg, dtype, d):
            super().__init__(cfg, dtype, d)
            self.gate_scale = model._p(d, ("layers", "kv_heads", "experts"), dtype, model.BIAS)

    monkeypatch.setattr(model, "Layers", LayersPlus)
    monkeypatch.setitem(names.TABLES, "hf", names.HF + (
        names.Name("layers/gate_scale", "model.layers.{layer}.mlp.gate_scale", "experts, kv_heads"),))
    monkeypatch.setitem(names.TABLES, "original", names.ORIGINAL + (
        names.Name("layers/gate_scale", "block.{layer}.mlp.gate_scale", "experts, kv_heads"),))
    cfg = CONFIG_A
    L, K, E = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.num_experts
    import jax

    init = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0)))  # traced, not compiled
    assert init["layers"]["gate_scale"].shape == (L, K, E) and init["layers"]["gate_scale"].dtype == np.float32
    params = checkpoint_writer.random_params(cfg, 3)
    new = params["layers"]["gate_scale"]
    assert new.shape == (L, K, E) and np.abs(new.astype(np.float32)).max() > 0

    d = str(tmp_path / "ck")
    checkpoint_writer.write_hf(d, cfg, params, num_shards=2)
    checkpoint_writer.write_original(os.path.join(d, "original"), cfg, params)
    ck = open_checkpoint(d)
    assert ck.source.header["model.layers.3.mlp.gate_scale"] == ("BF16", (E, K))  # stored transposed, as mapped
    for layout in ("hf", "original"):
        got = load_checkpoint(d, "bfloat16", layout=layout, progress=False)[1]["layers"]["gate_scale"]
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), new.view(np.uint16), err_msg=layout)

    specs = sharding.param_partition_specs(cfg, ParallelConfig(), "bfloat16")
    assert specs["layers"]["gate_scale"] == Ps("pipeline", None, None)
    engine = PrefillEngine.from_checkpoint(d, ParallelConfig(2, 2, 2), progress=False)
    placed = engine.params["layers"]["gate_scale"]
    assert placed.sharding.spec == Ps("pipeline", None, None) and placed.shape == (L, K, E)
    np.testing.assert_array_equal(np.asarray(placed).view(np.uint16), new.view(np.uint16))
    orbax_store.convert(d, str(tmp_path / "ob"), ParallelConfig(2, 2, 2), progress=False)
    restored = orbax_store.restore(str(tmp_path / "ob"), ParallelConfig(1, 2, 4))[1]["layers"]["gate_scale"]
    np.testing.assert_array_equal(np.asarray(restored).view(np.uint16), new.view(np.uint16))

    # the loader's shape check covers it, naming the config fields of each axis
    f = os.path.join(d, "original", "model.safetensors")
    _rewrite(f, lambda t: t.__setitem__("block.1.mlp.gate_scale", np.zeros((E, K + 1), t["norm.scale"].dtype)))
    with pytest.raises(CheckpointError, match=r"gate_scale.*expected \[6, 4\] = \[6 \(num_experts\), "
                                              r"4 \(num_key_value_heads\)\]"):
        open_checkpoint(d, "original")
    # and a checkpoint written before the parameter existed is refused, naming the missing tensor
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.0\.mlp\.gate_scale"):
        open_checkpoint(SHIPPED)


def test_name_maps_cover_the_declaration_and_rules_use_a_mesh_axis_once(monkeypatch):
    """Every declared parameter (both expert formats) has a name in each layout that can hold it, each row uses
    every declared axis exactly once, and the sharding rules refuse a mesh axis used twice in one parameter."""
    import dataclasses

    from slope_jax.checkpoints import hf, names
    from slope_jax.parallel import sharding, stages
    from slope_jax.parallel.config import ParallelConfig

    for fmt, layouts in (("mxfp4", ("hf", "original")), ("dense", ("hf",))):
        cfg = dataclasses.replace(CONFIG_A, expert_format=fmt)
        n_params = len(list(_flat(model.param_specs(cfg), leaf=model.ParamSpec)))
        for layout in layouts:
            table = hf.tensor_table(cfg, layout)
            assert {e.param for e in table} == {k for k, _ in _flat(model.param_specs(cfg), leaf=model.ParamSpec)}
            assert len({e.name for e in table}) == (3 + 19 * 4 if layout == "hf" and fmt == "mxfp4" else
                                                    3 + 17 * 4 if layout == "hf" else 3 + 15 * 4), (fmt, layout)
            assert n_params == len({e.param for e in table})
    with pytest.raises(ValueError, match="exactly once"):
        names.axis_groups(names.Name("layers/wq", "x", "q_heads*head_dim"), ("q_heads", "head_dim", "embed"))
    monkeypatch.setitem(stages.LOGICAL_RULES, "experts", "pipeline")
    with pytest.raises(ValueError, match="used twice"):
        sharding.param_partition_specs(CONFIG_A, ParallelConfig(pipeline=2), "bfloat16")


def test_weights_digest_follows_a_same_size_rewrite_that_keeps_the_mtime(tmp_path):
    """Weights rewritten in place with other bytes of the same size, the modification time put back (a rewrite within
    one tick of the file system's clock): the digest — the identity prefix caches and KV exports carry — changes."""
    from slope_jax.kv import prefix as prefix_lib

    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 4096)
    first = prefix_lib.weights_digest(str(tmp_path))
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.write(b"\1" * 4096)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert prefix_lib.weights_digest(str(tmp_path)) != first


@pytest.mark.parametrize("change, fields", [
    (dict(layer_types=("full_attention", "sliding_attention", "sliding_attention", "full_attention")),
     ["layer_types="]),
    (dict(rope_truncate=True), ["rope_truncate=True"]),
    (dict(max_position_embeddings=4096, rms_norm_eps=1e-6), ["max_position_embeddings=4096", "rms_norm_eps=1e-06"]),
    (dict(swiglu_alpha=1.5), ["swiglu_alpha=1.5"]),
])
def test_an_original_layout_is_never_written_for_a_config_it_cannot_express(tmp_path, change, fields):
    """OpenAI's original/config.json has no layer_types (sliding on even layers), no YaRN truncate, no
    max_position_embeddings (initial_context_length × factor), no rms_norm_eps or swiglu_alpha: a config outside
    those was written anyway and loaded back as another model (a held-out probe: logits 0.57–2.1 off transformers).
    The writer refuses it naming each field and what it would have read as; the shipped and gpt-oss configs pass
    (every field reads back equal)."""
    import dataclasses

    cfg = dataclasses.replace(CONFIG_A, **change)
    with pytest.raises(ConfigError, match="original/config.json cannot express") as e:
        checkpoint_writer.write_original(str(tmp_path / "original"), cfg, {})
    assert all(f in str(e.value) for f in fields), str(e.value)
    assert not os.path.exists(tmp_path / "original")  # refused before anything is written
    for name in ("tiny.json", "tiny-hd64.json", "gpt-oss-20b.json", "gpt-oss-120b.json"):
        c = ModelConfig.from_json(os.path.join(REPO, "configs", name))
        assert ModelConfig.from_original_dict(c.to_original_dict()) == dataclasses.replace(
            c, eos_token_ids=(), pad_token_id=None, expert_format="mxfp4"), name
