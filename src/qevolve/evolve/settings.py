"""The settings of ``qevolve evolve``: one section per stage of the loop (rollout, eval, buffer, rerank,
probe, the online baselines grpo and ppo, the variants) and :class:`EvolveSettings`, every field of a run.

:class:`qevolve.evolve.loop.EvolveConfig` is the config a run is given: these settings, with its
``baselines`` checked against the registered recipes (:mod:`qevolve.evolve.recipes`).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Literal, TypeVar

from pydantic import Field, ValidationError, model_validator

from qevolve.config import Derived, StageConfig, merge_trees
from qevolve.critic.config import CriticConfig
from qevolve.critic.value import ValueConfig
from qevolve.models.loading import ModelConfig
from qevolve.policy.bc import BCConfig
from qevolve.policy.bppo import PolicyStageConfig
from qevolve.policy.dpo import DPOConfig
from qevolve.process_rewards.label import GroupAdvantageFields, LabelConfig
from qevolve.prompting import PromptConfig
from qevolve.rollouts.agent import AgentConfig

C = TypeVar("C", bound=StageConfig)


class RolloutSettings(StageConfig):
    split: str = Field("train", description="tasks the policy collects D_self on")
    tasks: Literal["split", "buffer_experts"] = Field(
        "split", description="split: the split's tasks (limit/task_stride apply); buffer_experts: the tasks of "
        "the buffer's expert demonstrations, so every self episode has an expert episode of its task (the "
        "pairs of the eto baseline)")
    limit: int | None = Field(None, ge=1, description="at most this many tasks (null: the whole split)")
    task_stride: int = Field(1, ge=1, description="every k-th task of the split (spreads a small limit over task types)")
    episodes_per_task: int = Field(1, ge=1, description="episodes per task")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="batching and decoding (greedy in the paper)")


class EvalSettings(StageConfig):
    splits: list[str] = Field(["seen", "unseen"], description="evaluation splits, after BC and after each iteration")
    limit: int | None = Field(None, ge=1, description="at most this many tasks per split (null: all)")
    task_stride: int = Field(1, ge=1, description="every k-th task of each split")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="batching and decoding (greedy)")


class BufferSettings(StageConfig):
    expert_source: Literal["bc", "extra"] = Field(
        "bc", description="D_expert of the buffer: bc = the demonstrations behaviour cloning trained on (the "
        "method); extra = other demonstrations of expert_path, disjoint from BC's (more expert data than SFT saw)")
    expert_path: str | None = Field(None, description="expert_source extra: the store to draw from (null: "
                                    "DATA_DIR/experts/ENV); expert_source bc reads bc.data.train_path")
    num_expert: int | None = Field(None, ge=1, description="a seeded subset of this many expert episodes "
                                   "(null: all of the source); the same subset in every iteration")
    self_data: Literal["refresh", "accumulate"] = Field(
        "refresh", description="refresh: D_self is this iteration's rollouts (the paper); accumulate: all iterations'")
    only_won_expert: bool = Field(True, description="keep only successful expert episodes")


class RerankSettings(StageConfig):
    """The rerank baseline: the iteration's starting policy acts, the iteration's critic picks among samples."""

    num_candidates: int = Field(4, ge=2, description="candidate turns sampled per state")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature of the candidates")
    q_source: Literal["online", "target"] = Field("online", description="Q heads that score the candidates")
    limit: int | None = Field(None, ge=1, description="at most this many tasks per split (null: eval.limit); "
                              "re-ranking costs a critic pass per turn")
    task_stride: int | None = Field(None, ge=1, description="every k-th task of each split (null: "
                                    "eval.task_stride); spreads a smaller evaluation over the task types")


class ProbeSettings(StageConfig):
    """The format probe: one greedy turn of each trained policy on fixed held-out states, before its evaluation."""

    states: int = Field(32, ge=0, description="states probed per policy (stages bc/probe, iter_k/probe, ...): "
                        "turns of expert demonstrations that no training stage used when there are any, else of "
                        "behaviour cloning's demonstrations; the same states for every policy of the run (0: no probe)")
    max_format_error_increase: float = Field(0.2, description="warn when a trained policy's probe format-error "
                                             "rate exceeds the BC policy's by more than this (a share, 0.2 = 20 "
                                             "points)")


class LaunchSettings(StageConfig):
    """How many processes run each training stage of ``qevolve evolve`` (see docs/scaling.md)."""

    nproc_per_node: int | Literal["auto"] = Field(
        1, description="processes per training stage (bc, critic, policy updates, rft, eto): with more than 1, "
        "every training stage runs as `python -m torch.distributed.run --standalone --nproc_per_node N` over the "
        "run folder (DDP/FSDP as each section's distributed.backend says) while rollouts, evaluations, the buffer "
        "and the labels stay in the evolve process; 1: every stage in the evolve process; auto: one per visible "
        "CUDA GPU (1 without one)")
    nnodes: int = Field(
        1, description="machines (nodes) that run each training stage together, nproc_per_node processes on each: "
        "1: this machine only (torch's --standalone launcher); more: the evolve process is node 0 and every other "
        "node runs `qevolve evolve --config SAME --node-rank R`, which joins each training stage through torch's "
        "static rendezvous at master_addr:master_port; all nodes need the run folder on a shared file system")
    master_addr: str | None = Field(
        None, description="host name or address of node 0 (where `qevolve evolve` runs without --node-rank), "
        "reachable from every node; required when nnodes is above 1")
    master_port: int = Field(29500, description="TCP port on master_addr where node 0's launcher waits for the "
                             "other nodes at every training stage (free on node 0, open between the nodes)")
    join_timeout_s: float = Field(600.0, description="seconds a training stage waits for all nnodes nodes to join "
                                  "it before it fails (the rendezvous timeout, whole seconds)")
    heartbeat_timeout_s: float = Field(120.0, description="seconds a follower waiting between stages goes without "
                                       "a sign of life from node 0 (a counter node 0 advances in its launch file "
                                       "every heartbeat_timeout_s / 6 seconds) before it ends with an error: node 0 "
                                       "was killed or lost without ending its run")

    @model_validator(mode="after")
    def _positive(self) -> "LaunchSettings":
        if self.nproc_per_node != "auto" and self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={self.nproc_per_node}: expected auto or a count of at least 1")
        if self.nnodes < 1:
            raise ValueError(f"nnodes={self.nnodes}: expected a count of at least 1")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError(f"nnodes={self.nnodes} needs master_addr: the host of node 0, reachable from every node")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port={self.master_port}: expected a TCP port from 1 to 65535")
        if not self.join_timeout_s >= 1:
            raise ValueError(f"join_timeout_s={self.join_timeout_s}: expected at least 1 second")
        if not self.heartbeat_timeout_s >= 1:
            raise ValueError(f"heartbeat_timeout_s={self.heartbeat_timeout_s}: expected at least 1 second")
        return self

    def processes(self) -> int:
        """The count ``nproc_per_node`` stands for on this machine."""
        if self.nproc_per_node != "auto":
            return self.nproc_per_node
        import torch

        return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


class VariantSettings(StageConfig):
    """An ablation at equal data: iteration 1's critic, label and policy stages again with overrides."""

    critic: dict[str, Any] = Field(default_factory=dict, description="overrides of the critic config (a new "
                                   "critic is trained when non-empty, else the main one is reused)")
    label: dict[str, Any] = Field(default_factory=dict, description="overrides of the label config")
    policy: dict[str, Any] = Field(default_factory=dict, description="overrides of the policy config")


def grpo_policy_defaults() -> PolicyStageConfig:
    """A GRPO round's policy update, where it differs from the method's BPPO stage: the symmetric PPO clip
    (eps 0.2 both ways), KL to the BC policy with weight 0.01 (the k3 estimator, GRPO's "low variance KL"),
    advantages as labelled (the group normalisation already centred and scaled them within each task; a
    second standardisation over the round would rescale them by the share of groups that carry a signal),
    and a constant learning rate (each round is a stage of its own, whose schedule would otherwise warm
    up and decay every round)."""
    return PolicyStageConfig(objective={"name": "bppo", "eps_low": 0.2, "eps_high": 0.2, "kl_coef": 0.01},
                             standardize_advantages="none",
                             optim={"lr": 5e-5, "warmup_steps": 0, "min_lr_ratio": 1.0})


class OnlineRoundSettings(StageConfig):
    """What the online baselines share: rounds of rollouts of the current policy and an update, until a
    round count or an env-step budget is reached. A subclass names its ``method`` and its
    ``policy_defaults`` (a field given under ``policy`` changes that field of these defaults only)."""

    policy_defaults: ClassVar[Callable[[], PolicyStageConfig]]
    method: ClassVar[str]

    rounds: int | None = Field(4, ge=1, description="the most rounds (null: until env_steps is spent)")
    env_steps: int | None = Field(None, ge=1, description="budget of environment steps over all rounds' rollouts: "
                                  "checked before each round, which starts only while fewer steps were spent; a "
                                  "round is never cut, so the last one may pass the budget by less than one "
                                  "round's steps (the table reports the steps spent). null: rounds decides")
    tasks_per_round: int | None = Field(None, ge=1, description="a seeded subset of this many of the rollout "
                                        "tasks in each round (null: every task every round); the tasks are "
                                        "rollout's (split, tasks, limit, task_stride), those Q-Evolve's rollouts play")
    temperature: float = Field(1.0, gt=0.0, description="sampling temperature of the rounds' rollouts (the other "
                               "decoding settings are rollout.agent's)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass of the rounds' rollouts")
    evaluate_at_env_steps: list[int] = Field(
        default_factory=list, description="env-step budgets (increasing, each at most env_steps) at which the "
        "policy is evaluated on the way: after the first round whose rollouts, counted from round 1, reach a "
        "budget, that round's policy is probed and evaluated as stages <iter>/<name>/round_r/probe and "
        "<iter>/<name>/round_r/eval_<split> (unless it is the last round, whose policy <iter>/<name>/eval_<split> "
        "evaluates anyway); with a constant learning rate a run is a prefix of a run with a larger budget, so one "
        "run gives the points of several budgets. [] : only the last round's policy is evaluated")

    @model_validator(mode="before")
    @classmethod
    def _policy_starts_from_the_defaults(cls, data: Any) -> Any:
        # as for rft: a field given (policy.max_steps) changes that field of the method's defaults only
        if isinstance(data, dict) and isinstance(data.get("policy"), dict):
            data = {**data, "policy": merge_trees(cls.policy_defaults().model_dump(), data["policy"])}
        return data

    @model_validator(mode="after")
    def _can_stop_and_update(self) -> "OnlineRoundSettings":
        if self.rounds is None and self.env_steps is None:
            raise ValueError("rounds and env_steps are both null: set one, or the rounds would never stop")
        budgets = self.evaluate_at_env_steps
        if any(budget < 1 for budget in budgets):
            raise ValueError(f"evaluate_at_env_steps {budgets}: budgets are positive numbers of env steps")
        if any(later <= earlier for earlier, later in zip(budgets, budgets[1:])):
            raise ValueError(f"evaluate_at_env_steps {budgets}: list the budgets in increasing order, each once")
        if self.env_steps is not None and budgets and budgets[-1] > self.env_steps:
            raise ValueError(f"evaluate_at_env_steps {budgets}: {budgets[-1]} passes env_steps {self.env_steps}, "
                             "where the rounds stop")
        return self


class GRPOSettings(OnlineRoundSettings, GroupAdvantageFields):
    """The grpo baseline: online RL from iteration 1's starting policy (the BC policy), round by round.

    Each round r rolls the current policy out ``group_size`` times on each training task (sampled at
    ``temperature``), labels every turn of episode i with its group-normalised return
    A_i = (R_i - mean_task R) / (std_task R + eps) (``estimator: gigpo`` adds omega times the turn's
    discounted return-to-go normalised among the turns of its task that saw the same observation), and
    updates the policy with the PPO-clip objective and a KL penalty to the BC policy; the next round acts
    with the updated policy. No critic, no buffer."""

    group_size: int = Field(4, ge=2, description="episodes per task and round (the group G that each return is "
                            "compared with)")
    estimator: Literal["grpo", "rloo", "gigpo"] = Field(
        "grpo", description="group advantage: grpo (the return normalised within its task's group), rloo (the "
        "return minus the mean of the other returns of its task) or gigpo (GiGPO: grpo's advantage plus "
        "gigpo_weight times the turn's discounted return-to-go normalised among the turns of its task that "
        "acted on the same observation)")
    gamma: float = Field(0.95, ge=0.0, le=1.0, description="gigpo: the discount of the step-level returns-to-go "
                         "(the GiGPO paper's 0.95; grpo and rloo compare undiscounted returns and ignore it)")
    policy: PolicyStageConfig = Field(default_factory=grpo_policy_defaults, description="each round's policy update "
                                      "(defaults: objective bppo with eps_low = eps_high = 0.2 and kl_coef 0.01 to "
                                      "the BC policy, standardize_advantages none, constant lr 5e-5, one epoch "
                                      "over the round's rollouts); its model, buffer, reference, seed and output "
                                      "are set by the loop")

    policy_defaults = staticmethod(grpo_policy_defaults)
    method = "GRPO"


def ppo_policy_defaults() -> PolicyStageConfig:
    """A PPO round's policy update, where it differs from the method's BPPO stage: the symmetric PPO clip
    (eps 0.2 both ways), KL to the BC policy with weight 0.01 (as GRPO's, so the two baselines differ in
    their advantages only), the advantages standardised over the round's turns (PPO normalises its GAE
    advantages), and a constant learning rate (each round is a stage of its own, whose schedule would
    otherwise warm up and decay every round)."""
    return PolicyStageConfig(objective={"name": "bppo", "eps_low": 0.2, "eps_high": 0.2, "kl_coef": 0.01},
                             standardize_advantages="buffer",
                             optim={"lr": 5e-5, "warmup_steps": 0, "min_lr_ratio": 1.0})


class PPOSettings(OnlineRoundSettings):
    """The ppo baseline: online PPO from iteration 1's starting policy (the BC policy), round by round.

    Each round r rolls the current policy out ``episodes_per_task`` times on each training task (sampled at
    ``temperature``), fits the value head to the round's lambda-returns (computed with the head as the round
    before left it, V_old), labels every turn with GAE over r_env and V_old, and updates the policy with the
    PPO-clip objective and a KL penalty to the BC policy; the next round acts with the updated policy and
    starts from the fitted head. The value head reads the frozen hidden states of the BC policy."""

    episodes_per_task: int = Field(4, ge=1, description="episodes per task and round")
    gamma: float = Field(0.99, ge=0.0, le=1.0, description="discount of GAE and of the value head's lambda-returns")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (also the lambda of the value targets)")
    truncated_bootstrap: Literal["zero", "last_value"] = Field(
        "zero", description="V(s_T) after the last turn of a truncated (not done) episode: zero = the turn limit "
        "ends the task (as the critic's default); last_value = V_old of the last turn's own state")
    value: ValueConfig = Field(default_factory=ValueConfig, description="the value head, fitted every round on "
                               "the round's trajectories and carried to the next (its seed is set by the loop)")
    policy: PolicyStageConfig = Field(default_factory=ppo_policy_defaults, description="each round's policy update "
                                      "(defaults: objective bppo with eps_low = eps_high = 0.2 and kl_coef 0.01 to "
                                      "the BC policy, standardize_advantages buffer, constant lr 5e-5, one epoch "
                                      "over the round's rollouts); its model, buffer, reference, seed and output "
                                      "are set by the loop")

    policy_defaults = staticmethod(ppo_policy_defaults)
    method = "PPO"


def override(config: StageConfig, updates: dict[str, Any], where: str) -> StageConfig:
    """``config`` with nested ``updates`` laid over it, validated (errors name ``where``): a variant's
    overrides of a section, field by field."""
    try:
        return type(config).model_validate(merge_trees(config.model_dump(), updates))
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{where}.{field}: {first['msg']} (got {first.get('input')!r})") from None


def replaced(config: C, fields: dict[str, Any]) -> C:
    """``config`` with whole ``fields`` replaced (as ``model_copy(update=...)``, a field given is taken as a
    whole), validated: how the loop sets the fields it decides (model, seed, output folder, ...) on a
    stage's section."""
    return type(config).model_validate({**config.model_dump(), **fields})


def _policy_stage_fields(section: str, what: str) -> dict[str, Derived]:
    """The fields the loop sets when it builds a policy-training stage (BPPO/AWR, DPO) from ``section``."""
    return {
        f"{section}.env": Derived("env", f"the loop sets {what}'s environment from env"),
        f"{section}.model": Derived("model", f"the loop sets {what}'s model from model, starting from the "
                                    "policy it updates"),
        f"{section}.model.name_or_path": Derived(None, f"{what} starts from the iteration's policy"),
        f"{section}.prompt": Derived("prompt", "one prompt config for every stage"),
        f"{section}.buffer_path": Derived(None, f"{what} trains on the iteration's buffer"),
        f"{section}.reference": Derived(None, "the reference policy (of the KL term, of DPO's log-ratios) is the "
                                        "run's BC policy"),
        f"{section}.output_dir": Derived(None, "every stage writes into its folder of RUNS_DIR/NAME"),
        f"{section}.seed": Derived("seed", "each stage's seed derives from seed and the stage's name"),
        f"{section}.progress": Derived("progress", "one progress setting for the run"),
        f"{section}.resume": Derived(None, "--resume continues the stage from its last checkpoint"),
    }


#: The stage sections' fields that the loop's stages (:mod:`qevolve.evolve.stages`) set themselves
#: when they build each stage's config: dotted field (``*`` = any variant name) -> the field
#: that decides it. A YAML file or an override that sets one is refused naming that field
#: (``qevolve.config.load_config``); ``--show-config`` lists them as derived; a run's manifest leaves
#: them out (:func:`qevolve.evolve.loop.recorded_config`). Fields of the same sections that are not here
#: are read as given (e.g. bc.data.train_path, bc.data.num_demonstrations, bc.data.seed, rft.epochs,
#: critic.init).
DERIVED_FIELDS: dict[str, Derived] = {
    "bc.model": Derived("model", "the loop sets bc.model from model"),
    "bc.prompt": Derived("prompt", "one prompt config for every stage"),
    "bc.data.env": Derived("env", "behaviour cloning's demonstrations are of the run's environment"),
    "bc.data.task_types": Derived("task_types", "the task types restrict the whole protocol"),
    "bc.output_dir": Derived(None, "every stage writes into its folder of RUNS_DIR/NAME"),
    "bc.seed": Derived("seed", "each stage's seed derives from seed and the stage's name"),
    "bc.progress": Derived("progress", "one progress setting for the run"),
    "bc.resume": Derived(None, "--resume continues the stage from its last checkpoint"),
    "rollout.agent.seed": Derived("seed", "each stage's seed derives from seed and the stage's name"),
    "eval.agent.seed": Derived("seed", "each stage's seed derives from seed and the stage's name"),
    "critic.seed": Derived("seed", "each stage's seed derives from seed and the stage's name"),
    **_policy_stage_fields("policy", "the policy update"),
    "rft.model": Derived("model", "the loop sets rft.model from model, starting from the iteration's "
                         "starting policy"),
    "rft.model.name_or_path": Derived(None, "RFT starts from iteration 1's starting policy"),
    "rft.prompt": Derived("prompt", "one prompt config for every stage"),
    "rft.data.env": Derived("env", "RFT trains on the run's buffer"),
    "rft.data.train_path": Derived(None, "RFT trains on iteration 1's buffer"),
    "rft.data.only_won": Derived(None, "RFT is behaviour cloning on the buffer's won episodes"),
    "rft.data.task_types": Derived(None, "RFT takes every won episode of the buffer, whose task types "
                                   "task_types already restricts"),
    "rft.data.num_demonstrations": Derived(None, "RFT takes every won episode of the buffer"),
    "rft.output_dir": Derived(None, "every stage writes into its folder of RUNS_DIR/NAME"),
    "rft.seed": Derived("seed", "each stage's seed derives from seed and the stage's name"),
    "rft.progress": Derived("progress", "one progress setting for the run"),
    "rft.resume": Derived(None, "--resume continues the stage from its last checkpoint"),
    **_policy_stage_fields("eto", "the eto baseline"),
    **_policy_stage_fields("grpo.policy", "a GRPO round's update"),
    "grpo.policy.model.name_or_path": Derived(None, "each GRPO round starts from the policy of the round before "
                                              "(the first from iteration 1's starting policy)"),
    "grpo.policy.buffer_path": Derived(None, "each GRPO round trains on its own labelled rollouts"),
    **_policy_stage_fields("ppo.policy", "a PPO round's update"),
    "ppo.policy.model.name_or_path": Derived(None, "each PPO round starts from the policy of the round before "
                                             "(the first from iteration 1's starting policy)"),
    "ppo.policy.buffer_path": Derived(None, "each PPO round trains on its own labelled rollouts"),
    "ppo.value.seed": Derived("seed", "each stage's seed derives from seed and the stage's name"),
    # a variant's sections are overrides of critic, label and policy, built the same way
    "variants.*.critic.seed": Derived("seed", "each stage's seed derives from seed and the stage's name"),
    "variants.*.critic.init": Derived("critic.init", "every critic of the run starts from the same backbone "
                                      "(critic.init, else critic_init)"),
    **_policy_stage_fields("variants.*.policy", "a variant's policy update"),
}


class EvolveSettings(StageConfig):
    """Every setting of a run of the loop; a run is given them as
    :class:`qevolve.evolve.loop.EvolveConfig`, which also checks that ``baselines`` names registered recipes."""

    derived_fields: ClassVar[dict[str, Derived]] = DERIVED_FIELDS

    name: str = Field("run", description="run name: outputs go to RUNS_DIR/NAME")
    runs_dir: str = Field("runs", description="folder of run directories")
    env: str = Field("alfworld", description="environment")
    seed: int = Field(0, description="seed of every stage (each stage derives its own from it)")
    seeds: list[int] | None = Field(None, min_length=1, description="seed replicates: one run per seed, one after "
                                    "another, each in RUNS_DIR/NAME-sSEED with seed=SEED and resumable on its own "
                                    "(null: one run, RUNS_DIR/NAME with seed)")
    iterations: int = Field(1, ge=0, description="K, the number of self-evolving iterations")
    task_types: list[str] | None = Field(None, description="restrict the whole protocol (BC data, expert buffer, "
                                         "rollout and evaluation tasks) to these task types (null: all)")
    init_checkpoint: str | None = Field(None, description="reuse this BC policy instead of training one")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (null: torch's default)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the base policy model (BC starts from it)")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="one prompt config for BC, acting, "
                                 "critic tokenisation and BPPO")
    bc: BCConfig = Field(default_factory=BCConfig, description="behaviour cloning (its model, prompt, "
                         "environment, seed and output folder are set by the loop)")
    rollout: RolloutSettings = Field(default_factory=RolloutSettings, description="collecting D_self")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="evaluation")
    buffer: BufferSettings = Field(default_factory=BufferSettings, description="the hybrid buffer")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="weighted IQL critic (init: "
                                 "critic_init decides it unless given; its seed is set by the loop)")
    critic_init: Literal["bc", "base"] = Field("bc", description="critic backbone: the BC policy or the base model")
    label: LabelConfig = Field(default_factory=LabelConfig, description="process rewards")
    policy: PolicyStageConfig = Field(default_factory=PolicyStageConfig, description="BPPO (its model, prompt, "
                                      "reference, buffer, seed and output folder are set by the loop)")
    baselines: list[str] = Field(
        default_factory=list, description="recipes run at equal data from iteration 1's starting policy and "
        "buffer (qevolve evolve --show-config lists the registered ones): rft (rejection-sampling fine-tuning: "
        "BC on the buffer's won episodes, expert and self), eto (DPO on trajectory pairs of the same task), "
        "rerank (no policy update: the critic picks among sampled turns); and from the same starting policy but "
        "with rollouts of its own: grpo (online RL with group advantages, see the grpo section) and ppo (online "
        "PPO with a value head fitted online, see the ppo section); and 'package.module:name', the recipe name "
        "that importing package.module registers (a recipe of your own, from the command line)")
    rerank: RerankSettings = Field(default_factory=RerankSettings, description="the rerank baseline")
    probe: ProbeSettings = Field(default_factory=ProbeSettings, description="the format probe of each trained "
                                 "policy before its evaluation (generated with eval.agent's settings)")
    rft: BCConfig = Field(default_factory=lambda: BCConfig(epochs=1, grad_accum_steps=2),
                          description="the rft baseline's training (its data, model, prompt, seed and output are "
                          "set by the loop: the buffer's won episodes, starting from the iteration's policy)")
    eto: DPOConfig = Field(
        default_factory=DPOConfig, description="the eto baseline's DPO stage (its buffer, model, prompt, reference, "
        "seed and output are set by the loop); a section written when DPO was an objective of the policy stage "
        "(objective: {name: dpo, dpo_beta: ...}) still loads, its dpo_* keys read as beta, sft_coef, "
        "min_score_gap and max_pairs_per_task")
    grpo: GRPOSettings = Field(default_factory=GRPOSettings, description="the grpo baseline: rounds of "
                               "rollouts, group-normalised returns and a PPO-clip update, from the BC policy")
    ppo: PPOSettings = Field(default_factory=PPOSettings, description="the ppo baseline: rounds of rollouts, a "
                             "value head fitted to their lambda-returns, GAE and a PPO-clip update, from the BC "
                             "policy")
    variants: dict[str, VariantSettings] = Field(
        default_factory=dict, description="ablations at equal data: NAME -> overrides of the critic, label and "
        "policy stages, run in iteration 1 on its buffer (e.g. plain_iql: {critic: {weighting: {temporal: "
        "false, success: false}}})")
    distributed: LaunchSettings = Field(default_factory=LaunchSettings, description="the processes of each "
                                        "training stage (nproc_per_node; 1: in the evolve process)")
    tensorboard: bool = Field(True, description="TensorBoard scalars in RUNS_DIR/NAME/tensorboard")
    wandb: bool = Field(False, description="also log to Weights & Biases (needs the wandb package)")
    progress: bool = Field(True, description="progress bars")
    keep_finished_checkpoints: bool = Field(
        False, description="keep a training stage's in-stage checkpoints (STAGE/checkpoints: weights and optimizer "
        "state, 1.6 GB each for the 135M model's full fine-tuning) after the stage has finished; they only serve "
        "to resume an interrupted stage, and its result is STAGE/final. false: deleted once the stage is "
        "recorded (its manifest digests were taken before)")

    @model_validator(mode="before")
    @classmethod
    def _baselines_start_from_their_own_defaults(cls, data: Any) -> Any:
        # rft has defaults of its own (one epoch and 2-step accumulation), not its class's. A YAML or override
        # that sets one of its fields (rft.save_every=3) must change that field only; without this the section
        # was rebuilt from the class defaults.
        if isinstance(data, dict):
            for name in ("rft",):
                given = data.get(name)
                if isinstance(given, dict):
                    default = cls.model_fields[name].default_factory().model_dump()  # type: ignore[misc]
                    data = {**data, name: merge_trees(default, given)}
        return data

    @model_validator(mode="after")
    def _variants_apply(self) -> "EvolveSettings":
        # A bad override fails here, at start-up, not after BC and the first iteration.
        for name, settings in self.variants.items():
            for part in ("critic", "label", "policy"):
                override(getattr(self, part), getattr(settings, part), f"variants.{name}.{part}")
        return self


