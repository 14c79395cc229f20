"""Load the tokenizer and the model a recipe names: hub id, local folder, or GGUF file."""

from __future__ import annotations

import contextlib
from pathlib import Path

from llmtune.errors import UserError


def model_source(recipe) -> tuple[str, str | None]:
    """(what from_pretrained loads, the GGUF file it came from or None)."""
    name = recipe.base_model
    if name.endswith(".gguf"):
        from llmtune.train.model.gguf import materialize_gguf

        if not Path(name).is_file():
            from huggingface_hub import hf_hub_download

            repo, _, file = name.rpartition("/")
            name_on_disk = hf_hub_download(repo, file, revision=recipe.revision_of_model)
            return str(materialize_gguf(name_on_disk)), name
        return str(materialize_gguf(name)), name
    return name, None


def raised_inside(err: BaseException, package: str) -> bool:
    """Whether the innermost frames of err's traceback lie in that package."""
    import traceback

    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and f"/{package}/" in frames[-1].filename.replace("\\", "/")


def _hub_error(err: Exception, what: str, name: str) -> UserError:
    first = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
    return UserError(f"could not load the {what} from '{name}' ({first})",
                     "check base_model, your network or HF_TOKEN; a local folder or .gguf file also works")  # fmt: skip


def load_tokenizer(recipe, source: str):
    from transformers import AutoTokenizer

    from llmtune.train.data.templates import resolve_chat_template, use_template_kwargs

    name = recipe.tokenizer_config or adapter_tokenizer(recipe) or source
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, trust_remote_code=recipe.trust_remote_code, use_fast=recipe.tokenizer_use_fast,
            revision=recipe.revision_of_model if name == recipe.base_model else None,
        )  # fmt: skip
    except (OSError, ValueError) as err:
        raise _hub_error(err, "tokenizer", name) from None
    add_recipe_tokens(recipe, tokenizer, name, source)
    if tokenizer.pad_token is None:
        # Padding is masked out by labels/attention, so reusing a token is safe.
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    if tokenizer.eos_token is None:
        raise UserError(f"the tokenizer of {name} has no eos_token", "set special_tokens: {eos_token: ...}")
    if recipe.chat_template and recipe.chat_template != "tokenizer_default":
        tokenizer.chat_template = resolve_chat_template(recipe.chat_template, recipe.chat_template_jinja, tokenizer)
    use_template_kwargs(tokenizer, recipe.chat_template_kwargs)
    tokenizer.padding_side = "right"
    return tokenizer


def embedding_rows(recipe, tokenizer) -> int:
    """The embedding rows a run's tokenizer needs (its added tokens), rounded up to 32 with
    resize_token_embeddings_to_32x: what training grows the base to, and what loading its adapter needs again."""
    from llmtune.plan.vocabulary import embedding_rows_for

    return embedding_rows_for(recipe, len(tokenizer))


def grow_embeddings(model, rows: int, recipe) -> None:
    """Resize the embeddings (and an untied output head) to `rows`, as Axolotl does: new rows at the mean of the old
    ones with mean_resizing_embeddings (transformers draws them around it), else the model's own initialisation;
    either from a generator seeded with the recipe's seed, so that every load of the model (each rank's, a
    preference run's frozen reference copy) gets the same rows."""
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):  # the run's own random stream goes on as it was
        torch.manual_seed(recipe.seed)
        model.resize_token_embeddings(rows, mean_resizing=recipe.mean_resizing_embeddings)


def adapter_tokenizer(recipe) -> str | None:
    """lora_model_dir's own tokenizer, where the run that trained it saved one: the tokens it added keep their ids
    (the adapter's embedding rows are theirs) and its chat template stays, without the recipe repeating them."""
    folder = Path(recipe.lora_model_dir) if getattr(recipe, "lora_model_dir", None) else None
    return str(folder) if folder is not None and (folder / "tokenizer_config.json").is_file() else None


def add_recipe_tokens(recipe, tokenizer, name: str, source: str) -> None:
    """special_tokens, then tokens, then special_tokens.additional_special_tokens (Axolotl's order). A token new
    to the vocabulary gets a freshly initialised embedding row: with an adapter it trains only if the embedding
    and output layers are in lora_modules_to_save, so (as Axolotl does) anything else is refused."""
    from llmtune.plan.vocabulary import ADDITIONAL_SPECIAL_TOKENS, check_modules_to_save, new_tokens

    new = new_tokens(recipe, set(tokenizer.get_vocab()))
    named = {k: v for k, v in (recipe.special_tokens or {}).items() if k != ADDITIONAL_SPECIAL_TOKENS}
    additional = (recipe.special_tokens or {}).get(ADDITIONAL_SPECIAL_TOKENS) or []
    if named:
        tokenizer.add_special_tokens(named)
    if recipe.tokens:
        tokenizer.add_tokens(list(recipe.tokens))
    if additional:
        tokenizer.add_special_tokens({ADDITIONAL_SPECIAL_TOKENS: list(additional)})
    if new and recipe.adapter:  # (the tokenizer in memory only: a refusal leaves nothing changed on disk)
        modules, tied = embedding_modules(recipe, source)
        ids = [tokenizer.convert_tokens_to_ids(token) for _, token in new]
        check_modules_to_save(recipe, new, name, modules, ids, tied)


def embedding_modules(recipe, source: str) -> tuple[tuple[str, str], bool]:
    """The names of the model's input and output embedding modules, as lora_modules_to_save wants them, and whether
    the output head is tied to the input embedding."""
    from llmtune.plan.memory.facts import DEFAULT_EMBEDDING_MODULES, embedding_modules_of

    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(recipe.base_model_config or source,
                                                         trust_remote_code=recipe.trust_remote_code)  # fmt: skip
    except Exception:  # unreadable here: the common names
        return DEFAULT_EMBEDDING_MODULES, False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)))
    return embedding_modules_of(getattr(config, "model_type", None)), tied


def weights_dtype(recipe, precision: str, frozen: bool = False):
    """Full fine-tunes keep fp32 master weights (autocast does the rest); adapters freeze the base in 16 bits, and a
    frozen copy (preference training's reference) is held in 16 bits too: it never takes an update."""
    import torch

    if (recipe.adapter or frozen) and precision in ("bf16", "fp16"):
        return torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.float32


def quantization_config(recipe, dtype):
    if not (recipe.load_in_4bit or recipe.load_in_8bit):
        return None
    from transformers import BitsAndBytesConfig

    if recipe.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    # The packed 4-bit weights are stored in the compute dtype (8 weights per fp32 element, 4 per bf16), so they are
    # floating-point tensors of the model's dtype like every other parameter: ZeRO-3 partitions them and FSDP2
    # shards them (accelerate leaves uint8-stored ones out of FSDP2, whole on every rank).
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=recipe.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=recipe.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def quantized_device_map() -> dict | None:
    """Where bitsandbytes quantizes the weights while they load (None: transformers picks).

    On the CPU, whence the Trainer or FSDP moves them (a 4-bit weight's move takes its quantization state along).
    Under ZeRO-3 transformers refuses any device_map, and loads a quantized model without zero.Init whatever
    zero3_init_flag says: each rank quantizes the whole model on its current device (the GPU accelerate set, or
    the CPU), then the engine partitions the packed weights, and their quantization state (absmax, not a
    parameter) stays there, whole, where the forward pass runs.
    """
    from transformers.integrations import is_deepspeed_zero3_enabled

    return None if is_deepspeed_zero3_enabled() else {"": "cpu"}


def model_config(recipe, source: str, log):
    """The model's config (from base_model_config, read with cls_model_config, when given) with
    overrides_of_model_config applied."""
    import transformers

    from llmtune.train.model.config_overrides import apply_overrides

    name = recipe.base_model_config or source
    revision = recipe.revision_of_model if name == recipe.base_model else None
    config_class = transformers.AutoConfig
    if recipe.cls_model_config:
        config_class = getattr(transformers, recipe.cls_model_config, None)
        if config_class is None:
            raise UserError(f"cls_model_config: transformers has no {recipe.cls_model_config}",
                            "name a config class of this transformers version, or remove it")  # fmt: skip
    config = config_class.from_pretrained(name, trust_remote_code=recipe.trust_remote_code, revision=revision)
    apply_overrides(config, recipe.overrides_of_model_config, log)
    return config


def _checkpoint_quantization(recipe, kwargs: dict, log) -> None:
    """model_quantization_config: load an MXFP4 checkpoint dequantized, so its weights train in 16 bits."""
    if not recipe.model_quantization_config:
        return
    stored = getattr(kwargs["config"], "quantization_config", None) or {}
    method = stored.get("quant_method") if isinstance(stored, dict) else getattr(stored, "quant_method", None)
    if str(method).lower() != "mxfp4":
        log(f"model_quantization_config: {recipe.model_quantization_config}: no effect, the checkpoint is not "
            "MXFP4-quantized")  # fmt: skip
        return
    import transformers

    config_class = getattr(transformers, recipe.model_quantization_config)
    kwargs["quantization_config"] = config_class(**(recipe.model_quantization_config_kwargs or {}))


def reinitialise(model, log) -> None:
    """reinit_weights: every weight drawn afresh by the model's own initialisation (loaded ones are marked done)."""
    for item in [*model.modules(), *model.parameters()]:
        if hasattr(item, "_is_hf_initialized"):
            item._is_hf_initialized = False
    model.init_weights()
    log("reinit_weights: every weight re-initialised (training from scratch)")


def _distributed_config(recipe, mesh: dict, device: str | None):
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        raise UserError("tensor_parallel_size needs transformers' DistributedConfig (transformers >= 5.23)",
                        "pip install -U transformers") from None  # fmt: skip
    fsdp = recipe.resolved_fsdp()
    offload = bool(fsdp and fsdp[1].offload_params and device != "cpu")
    return DistributedConfig(tp_size=mesh["tensor_parallel"], fsdp_size=mesh["dp_shard"],
                             dp_replicate_size=mesh["dp_replicate"], fsdp_cpu_offload=offload)  # fmt: skip


HEADS = {  # recipe key -> (transformers auto class, peft task type)
    "reward_model": ("AutoModelForSequenceClassification", "SEQ_CLS"),
    "process_reward_model": ("AutoModelForTokenClassification", "TOKEN_CLS"),
}


def head_of(recipe) -> tuple[str, str]:
    """The auto class the recipe trains and its peft task type: a causal LM, or a reward model's classifier."""
    for key, head in HEADS.items():
        if getattr(recipe, key, False):
            return head
    return "AutoModelForCausalLM", "CAUSAL_LM"


def keep_present_layer_classes(model) -> None:
    """_no_split_modules, which FSDP's wrap policy reads when no class is named, cut to the classes this model holds:
    a text model of a multimodal family lists its vision block too (Qwen3.5), and accelerate refuses a class it
    can't find."""
    listed = getattr(model, "_no_split_modules", None)
    if not listed:
        return
    present = {type(module).__name__ for module in model.modules()}
    kept = [name for name in listed if name in present]
    if kept and len(kept) < len(listed):
        model._no_split_modules = set(kept) if isinstance(listed, set) else kept


def _from_pretrained(auto, source: str, kwargs: dict, kernels, log):
    """from_pretrained; where sdpa only stood in for flash_attention_2 (no flash-attn here, or a CPU rehearsal) and
    the model has no sdpa path (Gemma 2 soft-caps its attention logits), the model's own default instead, said."""
    try:
        return auto.from_pretrained(source, **kwargs)
    except ValueError as err:
        stood_in = kernels.attention_fallback and kwargs.get("attn_implementation") == "sdpa"
        if not stood_in or "attention implementation" not in str(err):
            raise
        kwargs = {key: value for key, value in kwargs.items() if key != "attn_implementation"}
        model = auto.from_pretrained(source, **kwargs)
    kernels.attention = None
    log(f"attention: {type(model).__name__} has no sdpa path, so its own default attention stands in for "
        "flash_attention_2 here")  # fmt: skip
    return model


def load_model(recipe, source: str, tokenizer, precision: str, device_map=None, device: str | None = None,
               mesh: dict | None = None, frozen: bool = False):  # fmt: skip
    """The model, with the recipe's GPU kernels applied (device: 'cuda' or 'cpu'; default: whether CUDA is visible).
    With a tensor-parallel mesh (the plan's), transformers loads it already split: its tp_plan across
    tensor_parallel ranks, FSDP2 across dp_shard ranks and replicas across dp_replicate."""
    import transformers

    from llmtune.train.model.kernels import apply_kernels, kernels_for
    from llmtune.train.runtime.progress import log

    kernels = kernels_for(recipe, precision, device)
    dtype = weights_dtype(recipe, precision, frozen)
    kwargs = {"dtype": dtype, "trust_remote_code": recipe.trust_remote_code}
    if kernels.attention:  # flash_attention_2 only where it can run; sdpa otherwise (said in the plan)
        kwargs["attn_implementation"] = kernels.attention
    quant = quantization_config(recipe, dtype)
    if quant is not None:
        kwargs["quantization_config"] = quant
        placement = device_map or quantized_device_map()
        if placement is not None:
            kwargs["device_map"] = placement
    if source == recipe.base_model:
        kwargs["revision"] = recipe.revision_of_model
    if mesh:
        kwargs["distributed_config"] = _distributed_config(recipe, mesh, device)
    try:
        if (recipe.base_model_config or recipe.cls_model_config or recipe.overrides_of_model_config
                or recipe.model_quantization_config):  # fmt: skip
            kwargs["config"] = model_config(recipe, source, log)
            _checkpoint_quantization(recipe, kwargs, log)
        auto = head_of(recipe)[0]
        if recipe.num_labels:  # a reward model's head: a new layer of num_labels outputs
            if "config" in kwargs:
                kwargs["config"].num_labels = recipe.num_labels
            else:
                kwargs["num_labels"] = recipe.num_labels
        linear = contextlib.nullcontext()
        if recipe.llama4_linearized_experts:
            from llmtune.train.model import linearize

            config = kwargs.get("config") or transformers.AutoConfig.from_pretrained(
                source, trust_remote_code=recipe.trust_remote_code, revision=kwargs.get("revision"))  # fmt: skip
            if linearize.applies(recipe, config):
                linear = linearize.linear_experts(config)
            else:
                log(
                    f"llama4_linearized_experts: no effect on a {config.model_type} model (Llama 4 only, as in Axolotl)"
                )
        with linear:
            model = _from_pretrained(getattr(transformers, auto), source, kwargs, kernels, log)
        if not isinstance(linear, contextlib.nullcontext):
            linearize.fill_from_fused(model, source, kwargs.get("revision"), quant is not None, log)
    except (OSError, ValueError) as err:
        if raised_inside(err, "deepspeed"):
            raise  # DeepSpeed's own failure under zero.Init (an op build, an offload path): not the model's source
        first = str(err).splitlines()[0].split(" Please request")[0][:200] if str(err) else type(err).__name__
        if isinstance(err, ValueError) and "attention implementation" in first:  # the model, not where it came from
            raise UserError(f"{source}: {first} (the recipe asks for attn_implementation "
                            f"{kwargs.get('attn_implementation')})", "remove sdp_attention / flash_attention / "
                            "attn_implementation (the model's default is used), or set eager_attention: true") from None  # fmt: skip
        raise _hub_error(err, "model", source) from None
    loaded = type(model).__name__
    if (
        recipe.model_type
        and recipe.model_type.endswith("ForConditionalGeneration")
        and (loaded == recipe.model_type.replace("ForConditionalGeneration", "ForCausalLM"))
    ):  # a multimodal checkpoint's text model: what a text fine-tune trains
        log(f"model_type {recipe.model_type}: training its text model, {loaded} (no vision weights are loaded)")
    elif recipe.model_type and not recipe.model_type.startswith("Auto") and loaded != recipe.model_type:
        raise UserError(f"model_type is {recipe.model_type} but {source} loads as {type(model).__name__}",
                        f"remove model_type or set it to {auto}")  # fmt: skip
    if recipe.num_labels:  # the classifier reads the last non-pad token of each row
        model.config.pad_token_id = tokenizer.pad_token_id
    if recipe.reinit_weights:
        reinitialise(model, log)
    weight = model.get_input_embeddings().weight
    embeddings = getattr(weight, "ds_shape", weight.shape)[0]  # ZeRO-3 partitioned: the full shape is ds_shape
    rows = embedding_rows(recipe, tokenizer)
    if rows > embeddings:
        if mesh:
            raise UserError(f"the tokenizer has {rows} tokens but the model's embeddings {embeddings} rows; a "
                            "tensor-parallel model can't grow its embeddings",
                            "add the tokens in a one-process run first (or without tensor_parallel_size)")  # fmt: skip
        grow_embeddings(model, rows, recipe)
    keep_present_layer_classes(model)
    # Packed rows leak attention across examples when a KV cache exists (see DESIGN.md).
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True
    # Before adapters and wrapping: Liger patches the model's own modules and forward.
    apply_kernels(model, kernels, log)
    return model
