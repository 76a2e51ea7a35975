"""Which of our model's projections an adapter can go on, under the names transformers (and so peft) gives them.

    ours                     llama family (transformers)              gpt2 (transformers)
    blocks.i.attn.qkv        self_attn.q_proj, k_proj, v_proj         attn.c_attn
                             (rows [q; k; v] of our one matrix)
    blocks.i.attn.out_proj   self_attn.o_proj                         attn.c_proj
    blocks.i.mlp.gate        mlp.gate_proj                            -
    blocks.i.mlp.up          mlp.up_proj                              -
    blocks.i.mlp.fc          -                                        mlp.c_fc
    blocks.i.mlp.out_proj    mlp.down_proj                            mlp.c_proj

Our fused `qkv` takes one adapter per part it holds (q, k and v each their own pair of matrices), so that an
adapter trained here is, term for term, the one peft trains on a transformers model: its files load there. The
embeddings and the output layer take none (peft's "all-linear" leaves the output layer out as well).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem.errors import ConfigError
from lowmem.model import GPTConfig

ALL_TARGETS = "all"
# Groups a user may name instead of the projections one by one.
TARGET_GROUPS = {"attention": ("q_proj", "k_proj", "v_proj", "o_proj", "c_attn", "attn.c_proj"),
                 "mlp": ("gate_proj", "up_proj", "down_proj", "c_fc", "mlp.c_proj")}


@dataclass(frozen=True)
class AdapterSite:
    """One Linear of ours that takes adapters: its module name, the transformers module names of its row blocks in
    order (`parts`, with each block's number of rows), and the transformers prefix of the layer it sits in."""

    module: str
    parts: tuple[tuple[str, int], ...]
    layer_prefix: str

    def transformers_name(self, part: str) -> str:
        """The transformers module that holds `part` (`model.layers.0.self_attn.q_proj`)."""
        return f"{self.layer_prefix}.{part.split('.')[-1]}"


def adapter_sites(config: GPTConfig) -> list[AdapterSite]:
    """Every Linear of a model of `config` that can take adapters, with its parts under transformers' names."""
    sites = []
    for i in range(config.n_layer):
        if config.architecture == "gpt2":
            attention, mlp = f"transformer.h.{i}.attn", f"transformer.h.{i}.mlp"
            sites += [AdapterSite(f"blocks.{i}.attn.qkv", (("c_attn", 3 * config.n_embd),), attention),
                      AdapterSite(f"blocks.{i}.attn.out_proj", (("attn.c_proj", config.n_embd),), attention),
                      AdapterSite(f"blocks.{i}.mlp.fc", (("c_fc", config.mlp_hidden),), mlp),
                      AdapterSite(f"blocks.{i}.mlp.out_proj", (("mlp.c_proj", config.n_embd),), mlp)]
        else:
            attention, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            q_rows, kv_rows = config.n_head * config.head_dim, config.kv_heads * config.head_dim
            sites += [AdapterSite(f"blocks.{i}.attn.qkv", (("q_proj", q_rows), ("k_proj", kv_rows),
                                                           ("v_proj", kv_rows)), attention),
                      AdapterSite(f"blocks.{i}.attn.out_proj", (("o_proj", config.n_embd),), attention),
                      AdapterSite(f"blocks.{i}.mlp.gate", (("gate_proj", config.mlp_hidden),), mlp),
                      AdapterSite(f"blocks.{i}.mlp.up", (("up_proj", config.mlp_hidden),), mlp),
                      AdapterSite(f"blocks.{i}.mlp.out_proj", (("down_proj", config.n_embd),), mlp)]
    return sites


def part_names(config: GPTConfig) -> tuple[str, ...]:
    """The projection names `--lora_targets` accepts for `config`'s architecture, in the model's order."""
    names: list[str] = []
    for site in adapter_sites(config)[:5]:
        names += [part for part, _ in site.parts if part not in names]
    return tuple(names)


def chosen_parts(targets: str, config: GPTConfig) -> frozenset[str]:
    """The parts `targets` (`--lora_targets`: "all", or a comma list of names and the groups "attention" and "mlp")
    names for `config`'s architecture; a name the architecture has not is an error that lists the ones it has."""
    known = part_names(config)
    wanted: set[str] = set()
    for name in (item.strip() for item in targets.split(",")):
        if name == ALL_TARGETS:
            wanted.update(known)
        elif name in TARGET_GROUPS:
            wanted.update(part for part in TARGET_GROUPS[name] if part in known)
        elif name == "c_proj" and config.architecture == "gpt2":
            wanted.update(("attn.c_proj", "mlp.c_proj"))  # peft's suffix match takes both
        elif name in known:
            wanted.add(name)
        else:
            raise ConfigError(
                f"--lora_targets names {name!r}, which a {config.architecture} model does not have. Name the "
                f"projections to put adapters on, separated by commas, from: {', '.join(known)} (or the groups "
                f"'attention' and 'mlp', or 'all', the default).")
    if not wanted:
        raise ConfigError("--lora_targets names no projection: give 'all' (the default) or a comma list such as "
                          "'q_proj,v_proj'.")
    return frozenset(wanted)


def canonical_targets(targets: str, config: GPTConfig) -> str:
    """`targets` in one spelling per set of projections: "all", else their names in the model's order (so that a
    resume given `v_proj,q_proj` or `attention` finds the run's `q_proj,v_proj` or `q_proj,k_proj,v_proj,o_proj`)."""
    parts, known = chosen_parts(targets, config), part_names(config)
    return ALL_TARGETS if parts == set(known) else ",".join(name for name in known if name in parts)


def peft_module_names(parts: frozenset[str]) -> list[str]:
    """The `target_modules` of peft's adapter_config.json for `parts`: peft matches each as a suffix of a module's
    name after a dot, so "attn.c_proj" names GPT-2's attention projection and not its MLP's."""
    return sorted(parts)
