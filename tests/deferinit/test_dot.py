"""The graphviz view of a record (issue 5): what the DOT source shows, and rendering.

Expectations come from what the constructors do in eager PyTorch (which ops,
in which order, on which tensors), not from the project's own output.
"""

import gc
import re
import shutil

import pytest
import torch
from torch import nn

from deferinit import deferred_init, to_dot
from deferinit.demo import LLAMA_70B, LLAMA_TINY, Llama
from deferinit.dot.style import ALIAS_EDGE, RNG_EDGE, STYLES, VIEW_EDGE, WRITE_EDGE
from deferinit.dot import (
    GraphFormatError,
    GraphViewError,
    GraphvizNotFoundError,
    write,
)
from deferinit.materialize import materialize_module

HAS_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAS_DOT, reason="Graphviz's `dot` program is not installed (apt-get install graphviz)")

_NODE = re.compile(r'^\s*(\w+) \[label="((?:[^"\\]|\\.)*)"(.*)\]$')
_EDGE = re.compile(r"^\s*(\w+) -> (\w+)(?: \[(.*)\])?$")


class Dot:
    """The DOT source parsed back: nodes (id -> label lines, attributes), edges, clusters."""

    def __init__(self, graph):
        self.source = graph.source
        self.nodes = {}
        self.edges = []
        self.clusters = re.findall(r'subgraph (cluster_\S+) \{\s*(?:[^\n]*?)label="?((?:[^"\\\n]|\\.)*)', self.source)
        for line in self.source.splitlines():
            m = _NODE.match(line)
            if m:
                self.nodes[m.group(1)] = (m.group(2).split("\\n"), m.group(3))
                continue
            m = _EDGE.match(line)
            if m:
                self.edges.append((m.group(1), m.group(2), m.group(3) or ""))

    def ops(self):
        """Op names of drawn op nodes, in recorded order."""
        out = []
        for nid, (lines, _) in sorted(
            ((k, v) for k, v in self.nodes.items() if re.fullmatch(r"n\d+", k)), key=lambda kv: int(kv[0][1:])
        ):
            out.append(lines[0].split(" ", 1)[1])
        return out

    def find(self, text):
        """Ids of nodes whose first label line contains ``text``."""
        return [k for k, (lines, _) in self.nodes.items() if text in lines[0]]

    def one(self, text):
        found = self.find(text)
        assert len(found) == 1, (text, found)
        return found[0]

    def edge(self, a, b):
        found = [attrs for x, y, attrs in self.edges if (x, y) == (a, b)]
        assert len(found) == 1, (a, b, self.edges)
        return found[0]

    def fill(self, nid):
        return re.search(r'fillcolor="([^"]+)"', self.nodes[nid][1]).group(1)

    def cluster_labels(self):
        return [label for _, label in self.clusters]


def styled(attrs: str, style: dict) -> bool:
    """Whether DOT edge attributes carry every attribute of ``style``."""
    return all(re.search(rf'{k}="?{re.escape(v)}"?', attrs) for k, v in style.items())


def test_embedding_ops_names_and_mutation_edges():
    # nn.Embedding: weight = Parameter(empty(10, 4)); normal_(weight); weight[0].fill_(0)
    # A model an earlier test deferred and dropped, still alive in a reference
    # cycle (a pytest.raises traceback), would precede this record in the
    # generator's chain and add its draws to the picture.
    gc.collect()
    d = Dot(to_dot(deferred_init(nn.Embedding, 10, 4, padding_idx=0)))
    ops = d.ops()
    assert ops[0].startswith("aten.empty")
    assert [o for o in ops if o != "aten.detach"][1:] == ["aten.normal_", "aten.select.int", "aten.fill_.Scalar"]
    empty, normal, select, fill = (d.one(x) for x in ("aten.empty", "aten.normal_", "aten.select", "aten.fill_"))
    # Factory shows its shape; categories are drawn in their colours.
    assert "[10, 4], float32, cpu" in d.nodes[empty][0]
    assert d.fill(empty) == STYLES["factory"][0]
    assert d.fill(normal) == STYLES["random"][0]
    assert d.fill(select) == STYLES["view"][0]
    assert d.fill(fill) == STYLES["write"][0]
    # select is a view of the weight as normal_ left it; fill_ writes the select in place.
    assert styled(d.edge(normal, select), VIEW_EDGE)
    assert styled(d.edge(select, fill), WRITE_EDGE)
    assert d.nodes[select][0][1] == "0, 0" and d.nodes[fill][0][1] == "0"
    # The parameter: name, shape, dtype, device, kind; its final value is fill_'s.
    (tensor,) = [k for k in d.nodes if k.startswith("t")]
    assert d.nodes[tensor][0] == ["weight", "[10, 4] float32 cpu", "parameter"]
    assert d.edge(fill, tensor)


def test_write_through_an_alias_taken_before_an_earlier_write():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, 4))
            with torch.no_grad():
                row = self.w[1]  # a view taken before normal_
                self.w.normal_()
                row.fill_(7)

    torch.manual_seed(0)
    eager = M()
    assert torch.equal(eager.w[1], torch.full((4,), 7.0))  # what the record must say
    d = Dot(to_dot(deferred_init(M)))
    normal, select, fill = d.one("aten.normal_"), d.one("aten.select"), d.one("aten.fill_")
    assert styled(d.edge(select, fill), WRITE_EDGE)
    # fill_ writes memory as normal_ left it, which the select (taken before) does not show.
    assert styled(d.edge(normal, fill), ALIAS_EDGE)
    (tensor,) = [k for k in d.nodes if k.startswith("t")]
    assert d.edge(fill, tensor)


def test_buffers_in_place_fills_and_constants():
    d = Dot(to_dot(deferred_init(nn.BatchNorm1d, 6)))
    tensors = {d.nodes[k][0][0]: d.nodes[k] for k in d.nodes if k.startswith("t")}
    assert set(tensors) == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    assert tensors["running_mean"][0][2] == "buffer" and "dashed" in tensors["running_mean"][1]
    assert tensors["weight"][0][2] == "parameter"
    assert tensors["num_batches_tracked"][0][1] == "[] int64 cpu"
    # reset_running_stats: zero_, fill_(1), zero_; reset_parameters: ones_ (fill_ 1), zeros_ (zero_)
    assert d.ops().count("aten.zero_") == 3 and d.ops().count("aten.fill_.Scalar") == 2
    for nid in d.find("aten.zero_") + d.find("aten.fill_"):
        assert d.fill(nid) == STYLES["write"][0]
        assert any(styled(a, WRITE_EDGE) for x, y, a in d.edges if y == nid)


def test_outside_tensor_and_opaque_initialiser():
    outside = torch.arange(4.0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, 4))
            nn.init.trunc_normal_(self.w, std=0.02)  # data-dependent: recorded as one opaque call
            self.register_buffer("b", torch.zeros(4) + outside)

    d = Dot(to_dot(deferred_init(M)))
    (ext,) = [k for k, (lines, attrs) in d.nodes.items() if "outside tensor" in lines[0]]
    assert "cylinder" in d.nodes[ext][1] and "[4] float32 cpu" in d.nodes[ext][0]
    (add,) = d.find("aten.add")
    assert d.edge(ext, add) == ""
    (opaque,) = d.find("trunc_normal_")
    assert d.fill(opaque) == STYLES["opaque"][0]
    assert d.nodes[opaque][0][1] == "0, 0.02, -2, 2"  # mean, std, a, b


def test_unused_random_draw_is_drawn_as_such():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            torch.randn(5)  # advances the generator; its result is dropped
            self.w = nn.Parameter(torch.randn(3))

    d = Dot(to_dot(deferred_init(M)))
    randns = d.find("aten.randn")
    assert len(randns) == 2
    unused = [k for k in randns if any("result unused" in line for line in d.nodes[k][0])]
    assert len(unused) == 1 and d.nodes[unused[0]][0][1].startswith("[5]")


def test_qualified_names_clusters_and_collapsed_blocks():
    m = deferred_init(Llama, LLAMA_TINY)  # 4 identical decoder layers
    d = Dot(to_dot(m))
    names = {d.nodes[k][0][0] for k in d.nodes if k.startswith("t")}
    per_layer = {n for n, _ in Llama(LLAMA_TINY).layers[0].named_parameters()}
    assert names == {"embed_tokens.weight", "norm.weight", "lm_head.weight"} | {f"layers.0.{n}" for n in per_layer}
    labels = d.cluster_labels()
    assert any(re.search(r"layers\.0 \.\. layers\.3 \(DecoderLayer\)\s+x4", label) for label in labels)
    assert "layers.0.self_attn (Attention)" in labels and "layers.0.self_attn.q_proj (Linear)" in labels
    assert not any("layers.1" in label for label in labels)
    # One block's ops are drawn: empty and init per tensor of the block, plus the rest.
    assert len(d.ops()) == 2 * (len(per_layer) + 3)

    full = Dot(to_dot(m, expand=True))
    full_names = {full.nodes[k][0][0] for k in full.nodes if k.startswith("t")}
    assert {f"layers.3.{n}" for n in per_layer} <= full_names
    assert not any(re.search(r"x\d+$", label) for label in full.cluster_labels())
    assert len(full.ops()) == 2 * (4 * len(per_layer) + 3)


def test_only_identical_neighbours_collapse():
    layers = lambda: nn.ModuleList(  # noqa: E731
        [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(4, 4), nn.Linear(4, 4, bias=False)]
    )
    d = Dot(to_dot(deferred_init(layers)))
    labels = d.cluster_labels()
    assert any(re.search(r"^0 \.\. 1 \(Linear\)\s+x2$", label) for label in labels)
    assert any(re.search(r"^2 \.\. 3 \(Linear\)\s+x2$", label) for label in labels)
    assert "4 (Linear)" in labels and "5 (Linear)" in labels  # different: bias or not
    names = {d.nodes[k][0][0] for k in d.nodes if k.startswith("t")}
    assert names == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias", "5.weight"}


def test_cloned_layers_collapse_and_keep_their_shared_source():
    # TransformerEncoder deep-copies one layer num_layers times: the copies read the same nodes.
    layer = lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32), num_layers=3, enable_nested_tensor=False)  # noqa: E731
    d = Dot(to_dot(deferred_init(layer)))
    assert any(re.search(r"layers\.0 \.\. layers\.2 .*x3", label) for label in d.cluster_labels())
    clones = d.find("aten.clone")
    assert clones and all(any(y == c for _, y, _ in d.edges) for c in clones)


def test_module_selection_and_earlier_draws():
    m = deferred_init(Llama, LLAMA_TINY)
    d = Dot(to_dot(m, module="layers.2"))
    names = {d.nodes[k][0][0] for k in d.nodes if k.startswith("t")}
    assert names == {f"layers.2.{n}" for n, _ in m.layers[2].named_parameters()}
    # Draws before layers.2 in construction order: the embedding's normal_, 7 Linear inits per layer.
    assert d.nodes["rng"][0][0] == f"{1 + 2 * 7} earlier random draws"
    first_random = d.find("aten.uniform_")[0]
    assert any(x == "rng" and styled(a, RNG_EDGE) for x, y, a in d.edges)
    assert first_random in d.nodes
    assert d.cluster_labels()[0].startswith("layers.2 (DecoderLayer)")
    with pytest.raises(GraphViewError, match="no submodule 'layers.9'"):
        to_dot(m, module="layers.9")


def test_depth_folds_modules_into_boxes():
    m = deferred_init(Llama, LLAMA_TINY)
    d = Dot(to_dot(m, depth=1))
    assert d.ops() == []
    boxes = {d.nodes[k][0][0]: d.nodes[k][0] for k in d.nodes if re.fullmatch(r"m\d+", k)}
    assert set(boxes) == {"embed_tokens", "layers", "norm", "lm_head"}
    eager = Llama(LLAMA_TINY)
    n_layers = sum(p.numel() for p in eager.layers.parameters())
    assert boxes["layers"][1] == "ModuleList"
    assert boxes["layers"][2].startswith(f"{4 * 9} tensors, {n_layers / 1e3:.3g}K elements")
    d2 = Dot(to_dot(m, depth=2))
    (box,) = [k for k in d2.nodes if re.fullmatch(r"m\d+", k) and d2.nodes[k][0][0].startswith("layers.")]
    assert d2.nodes[box][0][0] == "layers.0 .. layers.3   x4"
    assert len(Dot(to_dot(m, depth=2, expand=True)).find("layers.")) == 4
    assert len(Dot(to_dot(m, depth=0)).nodes) == 1  # one box (no legend node)


def test_a_single_tensor():
    m = deferred_init(nn.Linear, 3, 2)
    d = Dot(to_dot(m.bias, name="bias"))
    assert d.ops()[0].startswith("aten.empty") and "aten.uniform_" in d.ops()
    assert [d.nodes[k][0][0] for k in d.nodes if k.startswith("t")] == ["bias"]
    # weight's draw comes first and only advances the generator: summarised.
    assert d.nodes["rng"][0][0] == "1 earlier random draws"


def test_nothing_to_draw():
    with pytest.raises(GraphViewError, match="no deferred tensors"):
        to_dot(nn.Linear(2, 2))
    m = deferred_init(nn.Linear, 2, 2)
    materialize_module(m)
    with pytest.raises(GraphViewError, match="no deferred tensors"):
        to_dot(m)
    with pytest.raises(GraphViewError):
        to_dot("linear")
    with pytest.raises(GraphViewError):
        to_dot(deferred_init(nn.Linear, 2, 2), depth=-1)


def test_write_dot_source_and_bad_extension(tmp_path):
    g = to_dot(deferred_init(nn.Linear, 3, 2))
    path = write(g, tmp_path / "linear.dot")
    assert path.read_text().startswith("digraph")
    with pytest.raises(GraphFormatError, match=r"\.svg"):
        write(g, tmp_path / "linear.jpg")


def test_missing_dot_program_still_writes_the_source(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    g = to_dot(deferred_init(nn.Linear, 3, 2))
    with pytest.raises(GraphvizNotFoundError, match="apt-get install graphviz") as e:
        write(g, tmp_path / "linear.svg")
    assert e.value.dot_path == tmp_path / "linear.dot"
    assert "aten.uniform_" in e.value.dot_path.read_text()
    assert not (tmp_path / "linear.svg").exists()


@needs_dot
def test_renders_svg(tmp_path):
    m = deferred_init(nn.Embedding, 10, 4, padding_idx=0)
    path = write(to_dot(m), tmp_path / "embedding.svg")
    svg = path.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "aten.fill_.Scalar" in svg and "weight" in svg


@needs_dot
def test_70b_record_renders_collapsed(tmp_path):
    model = deferred_init(Llama, LLAMA_70B, dtype=torch.bfloat16)
    d = Dot(to_dot(model))
    assert len(d.ops()) == 2 * (9 + 3)  # one of 80 blocks drawn: empty and init per tensor
    svg = write(to_dot(model), tmp_path / "llama70b.svg").read_text()
    assert "x80" in svg and "layers.0.mlp.up_proj.weight" in svg and "[28672, 8192] bfloat16 cpu" in svg
    assert "layers.1." not in svg


def _numbers_by_seq(graph):
    """``node.seq -> "%N"`` as a printed graph numbers its nodes."""
    return {n.seq: graph.name_of(n) for n in graph.nodes}


def _drawn_numbers(d):
    """``node.seq -> "%N"`` as the DOT view labels its op nodes (ids are n<seq>)."""
    return {int(k[1:]): lines[0].split(" ", 1)[0] for k, (lines, _) in d.nodes.items() if re.fullmatch(r"n\d+", k)}


@pytest.mark.filterwarnings("ignore")
def test_numbers_are_the_same_in_every_view_of_a_record():
    """Issue 14: to_dot(m, module="model.layers.3") and graph_of(m) label the same
    nodes with the same numbers, and so do graph_of of a submodule and to_dot of the
    whole model."""
    transformers = pytest.importorskip("transformers")
    from deferinit import graph_of

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )
    m = deferred_init(transformers.LlamaForCausalLM, config)
    whole = _numbers_by_seq(graph_of(m))
    assert sorted(int(v[1:]) for v in whole.values())[0] == 0   # the record's first op is %0
    views = [
        _drawn_numbers(Dot(to_dot(m, module="model.layers.3"))),
        _drawn_numbers(Dot(to_dot(m, module="model.layers.0.mlp"))),
        _drawn_numbers(Dot(to_dot(m, expand=True))),
        _numbers_by_seq(graph_of(m.model.layers[3])),
        _numbers_by_seq(graph_of(m.lm_head.weight)),
    ]
    for view in views:
        assert view and {seq: whole[seq] for seq in view} == view
    # Numbers follow recorded order: a later op has a larger number.
    ordered = [int(whole[s][1:]) for s in sorted(whole)]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered)


def test_numbers_of_a_module_made_by_two_records_follow_the_whole_model():
    first = deferred_init(nn.Linear, 4, 4)
    second = deferred_init(nn.Linear, 4, 2)
    m = nn.Sequential(first, second)
    from deferinit import graph_of

    whole = _numbers_by_seq(graph_of(m))
    assert min(int(v[1:]) for v in whole.values()) == 0
    drawn = _drawn_numbers(Dot(to_dot(m, module="1")))
    assert drawn and {seq: whole[seq] for seq in drawn} == drawn


def test_draws_kept_only_for_the_generator_state_are_marked_in_text():
    from deferinit import graph_of

    m = deferred_init(lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)))
    lines = str(graph_of(m[1])).splitlines()
    # Eagerly, layer 1's draws come after layer 0's two: those are replayed, their results unused.
    marked = [l for l in lines if l.endswith("# for the generator state")]
    assert len([l for l in marked if "uniform_" in l]) == 2
    assert len([l for l in marked if "empty" in l]) == 2
    assert sorted(l.rsplit("# ", 1)[1] for l in lines if l not in marked and "uniform_" in l) == ["bias", "weight"]
