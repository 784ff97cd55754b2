"""`pdmesh up --weights nvfp4`: the flag reaches every prefill and decode, their KV layouts
say so, and a request is served end to end by NVFP4 weights (tiny model, real processes).

The tiny random model is so peaked that native and NVFP4 weights stream the same tokens, so
the registered layouts (model fingerprint ``tiny+nvfp4@...``) are what prove the format."""

from __future__ import annotations

import pytest

from libs.engine.engine import Engine
from libs.engine.generate import generate
from libs.engine.kvpool import KvPool
from libs.engine.loader import load_model
from libs.engine.sampling import SamplingParams
from libs.member.kv_member import model_fingerprint
from libs.rpc.calls import open_channel, unary
from pdmesh.client import Done, GenerateClient
from pdmesh.localmesh import start_mesh
from pdmesh.supervisor import Plan
from pdmesh.v1 import bootstrap_pb2 as bpb
from pdmesh.v1 import bootstrap_pb2_grpc as bgrpc
from pdmesh.v1 import common_pb2 as cpb

PROMPT = "Tell me about the sea."


def test_up_passes_weights_to_prefills_and_decodes_only():
    for child in Plan(model="tiny", weights="nvfp4", prefill=2, decode=2).children():
        argv = " ".join(child.argv)
        member = child.name.startswith(("prefill", "decode"))
        assert ("--weights nvfp4" in argv) == member, child.name
    assert all("--weights native" in " ".join(c.argv) for c in Plan().children()
               if c.name.startswith(("prefill", "decode")))


def test_fingerprint_names_the_weight_format():
    """A native prefill must not pair with an NVFP4 decode: same name, other weights."""
    native, q = load_model("tiny"), load_model("tiny", weights_format="nvfp4")
    a, b = model_fingerprint(native), model_fingerprint(q)
    assert a != b and b.startswith("tiny+nvfp4@") and a.startswith("tiny@")


@pytest.fixture(scope="module")
def nvfp4_mesh(tmp_path_factory):
    mesh = start_mesh(
        tmp_path_factory.mktemp("nvfp4"), model="tiny", up_args=["--weights", "nvfp4"]
    )
    yield mesh
    mesh.stop()


def _colocated(fmt: str, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    loaded = load_model("tiny", weights_format=fmt)
    engine = Engine(loaded.config, loaded.weights, KvPool(loaded.config, 16, 16))
    return generate(engine, prompt_ids, params)


async def test_request_is_served_by_nvfp4_weights(nvfp4_mesh):
    """Both members registered NVFP4 layouts, and a request streams exactly the tokens of a
    colocated NVFP4 engine (seeded sampling: the stream is a function of the logits)."""
    channel = open_channel(nvfp4_mesh.bootstrap)
    try:
        members = (await unary(bgrpc.BootstrapStub(channel).ListMembers,
                               bpb.ListMembersRequest(), timeout=5)).members
    finally:
        await channel.close()
    kv_members = [m for m in members if m.role in (cpb.PREFILL, cpb.DECODE)]
    assert len(kv_members) == 2
    assert all(m.layout.model.startswith("tiny+nvfp4@") for m in kv_members), kv_members
    ids: list[int] = []
    async with GenerateClient(nvfp4_mesh.router) as client:
        async for item in client.generate(
            messages=[{"role": "user", "content": PROMPT}], max_tokens=24, temperature=1.0,
            seed=11,
        ):
            if isinstance(item, Done):
                done = item
            else:
                ids.extend(item.token_ids)
    assert done.completion_tokens == len(ids) >= 1
    tok = load_model("tiny").tokenizer
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=11)
    assert ids == _colocated("nvfp4", prompt_ids, params)
    assert nvfp4_mesh.log().count("nvfp4 weights") >= 2  # the prefill's and the decode's load


MODELOPT_EXPORT = "tests/engine/data/modelopt_tiny_w4a4"  # written by ModelOpt 0.47.0 itself


@pytest.fixture
def modelopt_mesh(tmp_path):
    mesh = start_mesh(tmp_path, model=MODELOPT_EXPORT)  # sync: start_mesh runs its own loop
    yield mesh
    mesh.stop()


async def test_a_real_modelopt_export_is_served_end_to_end(modelopt_mesh):
    """`pdmesh up --model DIR` on ModelOpt's own NVFP4 export (W4A4, input_scale ignored,
    with its 256-token tokenizer): the members load NVFP4 weights and a chat request
    streams exactly the tokens of a colocated engine on the same checkpoint."""
    ids: list[int] = []
    async with GenerateClient(modelopt_mesh.router) as client:
        async for item in client.generate(
            messages=[{"role": "user", "content": "what is the capital of france?"}],
            max_tokens=16, temperature=1.0, seed=5,
        ):
            if isinstance(item, Done):
                done = item
            else:
                ids.extend(item.token_ids)
    assert done.completion_tokens == len(ids) >= 1 and max(ids) < 256
    loaded = load_model(MODELOPT_EXPORT)
    assert loaded.weights_format == "nvfp4"
    assert modelopt_mesh.log().count("nvfp4 weights") >= 2  # the prefill's and the decode's
    prompt_ids = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is the capital of france?"}])
    engine = Engine(loaded.config, loaded.weights, KvPool(loaded.config, 16, 16))
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    assert ids == generate(engine, prompt_ids, params)
