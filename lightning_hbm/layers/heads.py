"""A model's heads: its output (vocabulary) heads (:func:`output_heads`) and its task heads, the layers a model's task
puts on its backbone (a classifier, a CTC projection, a QA span scorer).

Found by what the model is, not by class or module names: for a Hugging Face model, what lies outside its
``base_model`` (exactly what ``from_pretrained`` of a base checkpoint reports missing and initialises at random);
for a hand-written model, the last Linear on top of a backbone that narrows the hidden width to a few outputs.
A language model's vocabulary head (:func:`output_heads`: tied to or as wide as the
embedding) is pretrained with the embeddings and is no task head. LoRA trains task heads in full precision
(``modules_to_save``) and saves them with the adapter; ``QuantizedPrecision`` leaves them unquantized.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_hbm.layers.kinds import stored_in
from lightning_hbm.naming import under

# transformers' auto mappings (model class per config) -> peft's TaskType: the task is what the model class is
_TASKS = (
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING", "SEQ_CLS"),
    ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING", "TOKEN_CLS"),
    ("MODEL_FOR_QUESTION_ANSWERING_MAPPING", "QUESTION_ANS"),
    ("MODEL_FOR_CAUSAL_LM_MAPPING", "CAUSAL_LM"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING", "SEQ_2_SEQ_LM"),
)


def output_heads(module: nn.Module) -> list[str]:
    """Names of the output heads inside ``module``, one rule for every model.

    Per model: transformers' ``get_output_embeddings()``; else a Linear whose weight is an
    ``nn.Embedding``'s (a tied head); else the last registered Linear whose ``out_features`` is the
    vocabulary (the widest ``nn.Embedding``'s ``num_embeddings``): LitGPT's ``lm_head``, torchtune's
    ``output``, nanoGPT's untied ``lm_head``. The precision plugin keeps them in the compute dtype,
    LoRA leaves them alone and ``FusedLoss`` fuses them.
    """
    by_id = {id(m): n for n, m in module.named_modules()}
    heads: list[str] = []
    for sub in module.modules():
        getter = getattr(sub, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if isinstance(head, nn.Module) and id(head) in by_id and by_id[id(head)] not in heads:
            heads.append(by_id[id(head)])
    if heads:
        return heads
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return []
    linears = [(n, m) for n, m in module.named_modules() if hasattr(m, "out_features") and isinstance(getattr(m, "weight", None), nn.Parameter)]
    shared = {id(e.weight) for e in embeddings}
    tied = [n for n, m in linears if id(m.weight) in shared]
    if tied:
        return tied
    # the widest embedding is the vocabulary: narrower ones (positions, token types) would match classifiers
    vocab = max(e.num_embeddings for e in embeddings)
    wide = [n for n, m in linears if m.out_features == vocab]
    # a Linear inside a repeated block (an nn.ModuleList's element) is no head, even if its width equals the
    # vocabulary: LitGPT registers lm_head before its blocks, whose MLP may be as wide as a tiny vocabulary; and a
    # model with no head outside them has none (was: the last block's one, e.g. a BERT classifier's last
    # intermediate.dense when intermediate_size == vocab_size, kept unquantized as "the output head")
    in_blocks = {f"{n}.{i}" if n else str(i) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) for i in range(len(m))}
    outside = [n for n in wide if not under(n, in_blocks)]
    return outside[-1:]


def hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face models inside ``module`` (``module`` itself if it is one), with their names."""
    found = [(n, m) for n, m in module.named_modules() if hasattr(getattr(m, "config", None), "model_type")]
    # (a model found at the root, name "", holds every other)
    return [(n, m) for n, m in found if not any(o != n and (not o or under(n, [o])) for o, _ in found)]


def task_type(model: nn.Module) -> Optional[str]:
    """peft's ``TaskType`` name of a transformers model (``"SEQ_CLS"`` for a ``...ForSequenceClassification``, ...).

    Read from transformers' own auto mappings (the class registered for the model's config), so a subclass counts;
    ``None`` for a model no peft task covers (CTC, image classification, a bare encoder, a plain torch model).
    """
    config = getattr(model, "config", None)
    if not hasattr(config, "model_type"):
        return None
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return None
    for mapping_name, task in _TASKS:
        try:
            registered = getattr(modeling_auto, mapping_name)[type(config)]
        except (AttributeError, KeyError, ValueError, ImportError):
            continue
        classes = tuple(registered) if isinstance(registered, (tuple, list)) else (registered,)
        if isinstance(model, classes):
            return task
    return None


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _hf_task_heads(root: str, model: nn.Module, lm_heads: list[str]) -> list[str]:
    """The parameterised children of a transformers model outside its ``base_model`` (not its vocabulary head)."""
    base = getattr(model, "base_model", model)
    if base is model:  # a bare backbone (BertModel) or a model with no separate base (T5): no head of its own
        return []
    prefix = root + "." if root else ""
    heads = []
    for child_name, child in model.named_children():
        name = prefix + child_name
        if child is base or not _has_parameters(child) or any(under(h, [name]) for h in lm_heads):
            continue
        heads.append(name)
    return heads


def _head_on_backbone(module: nn.Module, hf_roots: list[str], lm_heads: list[str]) -> list[str]:
    """A hand-written model's head: its last Linear outside the repeated blocks and Hugging Face models, on a backbone.

    A backbone is a Hugging Face model or an ``nn.ModuleList`` of blocks; the head narrows (``out_features <=
    in_features``: classes, scores) and is not tied to another module. A plain MLP has no backbone: no head. The
    Linears beside it (same parent, same ``in_features``, narrowing) are heads of the same predictor.
    """
    blocks = [f"{n}.{i}" if n else str(i) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) for i in range(len(m))]
    if not hf_roots and not blocks:
        return []
    owners: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    storages = {id(s) for m in module.modules() for s in [stored_in(m)] if s is not None}  # a quantized conv's matrix
    outside = [
        (n, m)
        for n, m in module.named_modules()
        if isinstance(m, nn.Linear) and n and id(m) not in storages and not under(n, blocks) and not (hf_roots and under(n, hf_roots))
    ]
    if not outside:
        return []
    def narrows(name: str, layer: nn.Linear) -> bool:
        return name not in lm_heads and owners.get(id(layer.weight), 0) <= 1 and layer.out_features <= layer.in_features

    name, layer = outside[-1]
    if not narrows(name, layer):
        return []
    # The heads of one predictor are one head (torchvision FastRCNNPredictor: cls_score beside bbox_pred): its other
    # Linears on the same features, in the same parent, narrowing too. Found alone, the last one trained while its
    # sibling, narrower than r, stayed frozen at its random init: a new-class detector never learnt its classes.
    # Not in an nn.Sequential: its Linears run one after another (an MLP head's hidden layer is no sibling head).
    parent = name.rpartition(".")[0]
    if isinstance(module.get_submodule(parent), nn.Sequential):
        return [name]
    return [n for n, m in outside if n.rpartition(".")[0] == parent and m.in_features == layer.in_features and narrows(n, m)]


def task_heads(module: nn.Module) -> list[str]:
    """Names (relative to ``module``) of the task heads inside ``module``: see the module docstring.

    ``BertForSequenceClassification``: ``classifier``; ``Wav2Vec2ForCTC``: ``lm_head``; a ``...ForCausalLM``: none
    (its ``lm_head`` is the vocabulary head); an ``nn.TransformerEncoder`` with a ``Linear(128, 4)`` on top: that Linear.
    """
    lm_heads = output_heads(module)
    models = hf_models(module)
    heads = [h for root, model in models for h in _hf_task_heads(root, model, lm_heads)]
    roots = [root for root, _ in models]
    if "" in roots:  # module is itself a transformers model: nothing of it is hand-written
        return heads
    return heads + [h for h in _head_on_backbone(module, roots, lm_heads) if not under(h, heads)]


__all__ = ["hf_models", "output_heads", "task_heads", "task_type"]
