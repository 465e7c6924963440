"""The methods ``qevolve evolve`` runs, as recipes over the stages of :mod:`qevolve.evolve.stages`.

:func:`qevolve` is the method (method section 2, Algorithm 1), stage by stage:

    pi <- BC(D_expert)                                        stage bc (or a given checkpoint)
    probe pi's turn format on fixed held-out states          bc/probe
    evaluate pi on seen and unseen                            bc/eval_<split>
    for k in 1..K:
        D_self <- rollouts of pi on training tasks            iter_k/rollouts
        D      <- D_expert U D_self (tokenised once)          iter_k/buffer
        V, Q   <- weighted IQL on D with r_env + r_aux        iter_k/critic
        A_t    <- process rewards from V (GAE on r_env)       iter_k/label (and its audit, where the env judges actions)
        pi     <- BPPO on (s_t, a_t, A_t) of D                iter_k/policy
        probe pi's turn format (compared with BC's)           iter_k/probe
        evaluate pi on seen and unseen                        iter_k/eval_<split>

The critic stage runs when a stage reads it: labels whose estimator needs V or Q (not outcome, grpo,
rloo, gigpo, which label without a critic), a recipe registered with ``reads_critic`` (rerank), or a
variant that labels with it.

In iteration 1, after its own evaluation, the loop runs the recipes that ``baselines`` names, in
their order, from what the iteration started from (:class:`Start`: the BC policy, the buffer, the
critic), then the variants:

    rft     BC continued on the buffer's won episodes   iter_1/rft/{policy,probe,eval_<split>}
    eto     DPO on (better, worse) pairs of one task    iter_1/eto/{policy,probe,eval_<split>}
    rerank  the critic picks among sampled turns        iter_1/rerank/eval_<split>
    grpo    online RL from the same BC policy, on       iter_1/grpo/round_r/{rollouts,label,policy},
            rollouts of its own (no buffer, no critic)  iter_1/grpo/{probe,eval_<split>}
    ppo     online PPO from the same BC policy: its     iter_1/ppo/round_r/{rollouts,value,label,policy},
            rollouts, a value head fitted online, GAE   iter_1/ppo/{probe,eval_<split>}
    variant NAME: the critic/label/policy stages        iter_1/NAME/{critic,label,policy,probe,eval_<split>}
            again with overrides (plain IQL, Q - V, AWR)

The probe stages (``probe.states``; 0 leaves them out) generate one greedy turn of the policy on the
same fixed states for every policy and record its format-error rate, the share of turns cut at
``max_new_tokens`` and the generated lengths (:mod:`qevolve.evaluation.probe`), so a policy update
that broke the turn format is named before its evaluation plays a single episode.

A recipe of your own is a function ``recipe(run, start)`` registered by name; ``baselines: [NAME]``
runs it where the module that registers it was imported (a script calling ``run_evolve``), and
``baselines: [package.module:NAME]`` imports the module first, so ``qevolve evolve`` runs it too (the
module on PYTHONPATH or installed)::

    from qevolve.evolve.recipes import Run, Start, evaluate, probe, register_recipe
    from qevolve.evolve.stages import rft_stage

    @register_recipe("rft_twice")
    def rft_twice(run: Run, start: Start) -> None:
        \"\"\"RFT, then RFT again from its policy.\"\"\"
        prefix = f"{start.iteration}/rft_twice"
        first = run.stage(f"{prefix}/first", rft_stage, {"buffer": start.buffer, "start": start.policy})
        second = run.stage(f"{prefix}/policy", rft_stage, {"buffer": start.buffer,
                                                           "start": run.path(first.outputs["policy"])})
        probe(run, prefix, run.path(second.outputs["policy"]))
        evaluate(run, prefix, run.path(second.outputs["policy"]))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from qevolve.buffer.store import Episode
from qevolve.evolve.run_dir import StageRecord
from qevolve.evolve.settings import EvolveSettings, OnlineRoundSettings, VariantSettings, override
from qevolve.evolve.stages import (
    bc_stage, buffer_stage, critic_stage, eto_stage, eval_stage, expert_store, gae_label_stage, group_label_stage,
    label_stage, online_rollouts_stage, policy_stage, probe_stage, probe_states, rft_stage, rollouts_stage,
    value_stage,
)
from qevolve.process_rewards.label import LabelConfig


@dataclass
class Run:
    """A run as its recipes see it: its config and folder, and :meth:`stage` to run a stage in it."""

    config: EvolveSettings
    root: Path                                  # RUNS_DIR/NAME
    log: Callable[[str], None]
    #: the loop's stage runner (:func:`qevolve.evolve.loop.run_evolve`): name, stage, inputs, keyword options
    run_stage: Callable[[str, Callable[..., Any], dict[str, str], dict[str, Any]], StageRecord]
    probe_experts: Path | None = None           # the store of the probe's states; None: no probe stages
    bc_policy: str | None = None                # the run's BC policy, once stage bc has run
    bc_probe: dict[str, Any] | None = None      # the BC policy's probe metrics, which later probes compare with
    #: a dry run (``qevolve evolve --dry-run``): the stages only build their configs and return no metrics;
    #: an online baseline lists its first round only
    dry_run: bool = False
    _probe_states: tuple[list[tuple[Episode, int]], bool] | None = field(default=None, repr=False)

    def stage(self, name: str, stage: Callable[..., Any], inputs: dict[str, str], **options: Any) -> StageRecord:
        """Run ``stage(ctx, inputs, **options)`` as the stage ``name`` (a folder of the run, e.g.
        ``iter_1/critic``), or take its record when the run has it (``--resume``)."""
        return self.run_stage(name, stage, inputs, options)

    def path(self, recorded: str) -> str:
        """A recorded output (a path relative to the run) as the path the next stage reads."""
        return str(self.root / recorded)

    def probe_states(self) -> tuple[list[tuple[Episode, int]], bool]:
        """The probe's states (:func:`qevolve.evolve.stages.probe_states`), drawn once per run."""
        if self._probe_states is None:
            self._probe_states = probe_states(self.config)
        return self._probe_states


@dataclass(frozen=True)
class Start:
    """What the recipes of an iteration start from (iteration 1: the BC policy and the first buffer)."""

    iteration: str          # iter_k: a recipe NAME writes its stages under iter_k/NAME/
    policy: str             # the policy the iteration started from
    buffer: str             # the iteration's buffer (run-relative)
    critic: str | None      # the iteration's critic (run-relative); None when no stage read one
    labelled: str           # the iteration's labelled buffer (run-relative)


Recipe = Callable[[Run, Start], None]


@dataclass(frozen=True)
class RegisteredRecipe:
    """A recipe of the registry, with what the loop and ``--show-config`` read of it."""

    name: str
    recipe: Recipe
    description: str        # one line, for --show-config
    reads_critic: bool      # the iteration's critic is trained for it, even where the labels need none


#: recipe name -> the recipe; ``baselines`` takes these names
RECIPES: dict[str, RegisteredRecipe] = {}


def register_recipe(name: str, *, reads_critic: bool = False) -> Callable[[Recipe], Recipe]:
    """Register the decorated function ``recipe(run, start)`` as the recipe ``name``, which ``baselines``
    may then name. Its docstring's first line describes it in ``qevolve evolve --show-config``.
    ``reads_critic``: the recipe reads ``start.critic``, so the iteration trains its critic even when
    the labels need none."""
    if not name or "/" in name:
        raise ValueError(f"recipe name {name!r}: expected a non-empty name without '/' (it names a folder)")
    if name in ("rollouts", "buffer", "critic", "label", "policy", "probe") or name.startswith("eval_"):
        raise ValueError(f"recipe name {name!r}: a stage of every iteration has this name (its folder iter_k/{name})")

    def register(recipe: Recipe) -> Recipe:
        known = RECIPES.get(name)
        if known is not None and known.recipe is not recipe:
            raise ValueError(f"recipe {name!r} is registered already ({known.recipe.__module__}."
                             f"{known.recipe.__qualname__})")
        description = (recipe.__doc__ or "").strip().split("\n")[0]
        RECIPES[name] = RegisteredRecipe(name, recipe, description, reads_critic)
        return recipe

    return register


def registered_recipe(name: str) -> RegisteredRecipe:
    """The recipe ``name``, or of a spec ``"package.module:name"``: the recipe ``name`` that importing
    ``package.module`` registers (how ``baselines`` names a recipe of one's own from the command line,
    which imports no module of the user's otherwise; its stages are ``iter_1/name/...`` as the recipe
    names them). A one-line error naming ``name`` when there is none."""
    if ":" in name:
        return _recipe_of_spec(name)
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r} (registered recipes: {', '.join(RECIPES) or 'none'}); a recipe "
                         "that a module of yours registers: 'package.module:name'")
    return RECIPES[name]


def _recipe_of_spec(spec: str) -> RegisteredRecipe:
    import importlib

    module_name, _, name = spec.partition(":")
    if not module_name or not name or ":" in name:
        raise ValueError(f"recipe {spec!r}: expected 'package.module:name'")
    try:
        importlib.import_module(module_name)  # registers its recipes (register_recipe)
    except ModuleNotFoundError as err:
        # the module itself is not there (a module it imports that is missing keeps its traceback)
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise ValueError(f"recipe {spec!r}: cannot import module {module_name!r} ({err}); run from the folder "
                             "that holds it, put that folder on PYTHONPATH or install its package") from None
        raise
    if name not in RECIPES:
        raise ValueError(f"recipe {spec!r}: module {module_name!r} registers no recipe {name!r} (with "
                         f"register_recipe); registered recipes: {', '.join(RECIPES)}")
    return RECIPES[name]


# ------------------------------------------------------------------------------------------ what recipes share


def probe(run: Run, prefix: str, policy: str) -> None:
    """Stage ``<prefix>/probe``: the format probe of the policy at ``policy``, logged beside the BC policy's
    with a warning when its format-error rate rose by more than ``probe.max_format_error_increase``."""
    from qevolve.evaluation.probe import format_regression, probe_line

    if run.probe_experts is None:
        return
    metrics = run.stage(f"{prefix}/probe", probe_stage, {"policy": policy, "experts": str(run.probe_experts)},
                        states=run.probe_states).metrics
    if run.dry_run:
        return
    if prefix == "bc":
        run.bc_probe = metrics
    reference = run.bc_probe
    run.log(f"[{prefix}/probe] {probe_line(metrics, None if prefix == 'bc' else reference)}")
    if prefix != "bc" and reference is not None:
        warning = format_regression(metrics, reference, run.config.probe.max_format_error_increase)
        if warning:
            run.log(f"[{prefix}/probe] {warning}; see {run.root / prefix / 'probe' / 'probe.jsonl'}")


def evaluate(run: Run, prefix: str, policy: str, critic: str | None = None) -> None:
    """Stages ``<prefix>/eval_<split>``: the policy at ``policy`` on every evaluation split (its turns
    re-ranked by the critic at ``critic`` when given)."""
    for split in run.config.eval.splits:
        run.stage(f"{prefix}/eval_{split}", eval_stage, {"policy": policy, **({"critic": critic} if critic else {})},
                  split=split)


def label_inputs(buffer: str, critic: str | None, label: LabelConfig) -> dict[str, str]:
    """A label stage's inputs: the buffer, and the critic where its estimator reads one."""
    from qevolve.process_rewards.advantages import estimator_needs_critic

    if not estimator_needs_critic(label.estimator):
        return {"buffer": buffer}
    assert critic is not None  # main_critic_read saw to it
    return {"buffer": buffer, "critic": critic}


def main_critic_read(config: EvolveSettings) -> bool:
    """Whether a stage reads the iteration's critic (``iter_k/critic``), which is then trained: the labels
    when their estimator needs one (not outcome, grpo, rloo, gigpo), a baseline recipe that reads it
    (rerank), or a variant that labels with the main critic."""
    from qevolve.process_rewards.advantages import estimator_needs_critic

    return estimator_needs_critic(config.label.estimator) or any(
        registered_recipe(name).reads_critic for name in config.baselines) or any(
        not settings.critic and estimator_needs_critic(
            override(config.label, settings.label, f"variants.{name}.label").estimator)  # type: ignore[attr-defined]
        for name, settings in config.variants.items())


# ------------------------------------------------------------------------------------------ the method


def qevolve(run: Run) -> None:
    """Q-Evolve (Algorithm 1): BC, then per iteration rollouts -> buffer -> critic -> labels -> BPPO, every
    policy probed and evaluated; in iteration 1 the baselines and variants from the same start."""
    config = run.config
    bc = run.stage("bc", bc_stage, {"experts": str(config.bc.data.train_path or "")})
    run.bc_policy = config.init_checkpoint or run.path(bc.outputs["policy"])
    probe(run, "bc", run.bc_policy)
    evaluate(run, "bc", run.bc_policy)
    policy, own_rollouts = run.bc_policy, []
    for k in range(1, config.iterations + 1):
        it = f"iter_{k}"
        rollouts = run.stage(f"{it}/rollouts", rollouts_stage, {"policy": policy}).outputs["trajectories"]
        own_rollouts = [*own_rollouts, rollouts] if config.buffer.self_data == "accumulate" else [rollouts]
        buffer = run.stage(f"{it}/buffer", buffer_stage, {"experts": expert_store(config),
                                                          "self": ",".join(own_rollouts)},
                           self_trajectories=own_rollouts, tokenizer_of=policy).outputs["buffer"]
        critic = run.stage(f"{it}/critic", critic_stage, {"buffer": buffer}, critic=config.critic).outputs["critic"] \
            if main_critic_read(config) else None
        labelled = run.stage(f"{it}/label", label_stage, label_inputs(buffer, critic, config.label),
                             label=config.label).outputs["labelled"]
        updated = run.stage(f"{it}/policy", policy_stage, {"labelled": labelled, "start": policy}, policy=config.policy)
        start, policy = policy, run.path(updated.outputs["policy"])
        probe(run, it, policy)
        evaluate(run, it, policy)
        if k == 1:  # after Q-Evolve's own evaluation, so a partial run has the main row first
            at_equal_data(run, Start(it, start, buffer, critic, labelled))


def at_equal_data(run: Run, start: Start) -> None:
    """The recipes ``baselines`` names, in its order, then the variants, all from ``start``."""
    for name in run.config.baselines:
        registered_recipe(name).recipe(run, start)
    for name, settings in run.config.variants.items():
        variant(run, start, name, settings)


def variant(run: Run, start: Start, name: str, settings: VariantSettings) -> None:
    """An ablation at equal data: the iteration's critic, label and policy stages again, each with the
    variant's overrides (a critic of its own only when it overrides the critic, else the iteration's)."""
    config = run.config
    prefix = f"{start.iteration}/{name}"
    critic = start.critic
    if settings.critic:
        critic_config = override(config.critic, settings.critic, f"variants.{name}.critic")
        critic = run.stage(f"{prefix}/critic", critic_stage, {"buffer": start.buffer},
                           critic=critic_config).outputs["critic"]
    labelled = start.labelled
    if settings.critic or settings.label:
        label = override(config.label, settings.label, f"variants.{name}.label")
        labelled = run.stage(f"{prefix}/label", label_stage, label_inputs(start.buffer, critic, label),
                             label=label).outputs["labelled"]
    policy_config = override(config.policy, settings.policy, f"variants.{name}.policy")
    updated = run.stage(f"{prefix}/policy", policy_stage, {"labelled": labelled, "start": start.policy},
                        policy=policy_config)
    probe(run, prefix, run.path(updated.outputs["policy"]))
    evaluate(run, prefix, run.path(updated.outputs["policy"]))


# ------------------------------------------------------------------------------------------ the baselines


@register_recipe("rft")
def rft(run: Run, start: Start) -> None:
    """Rejection-sampling fine-tuning: BC continued on the won episodes of the buffer.

    Stages ``<iter>/rft/policy`` (:func:`qevolve.evolve.stages.rft_stage`), then its probe and evaluation."""
    prefix = f"{start.iteration}/rft"
    trained = run.stage(f"{prefix}/policy", rft_stage, {"buffer": start.buffer, "start": start.policy})
    probe(run, prefix, run.path(trained.outputs["policy"]))
    evaluate(run, prefix, run.path(trained.outputs["policy"]))


@register_recipe("eto")
def eto(run: Run, start: Start) -> None:
    """Exploration-based trajectory optimisation: DPO on (better, worse) pairs of one task.

    Stages ``<iter>/eto/policy`` (the ``eto`` section, :func:`qevolve.evolve.stages.eto_stage`), then its
    probe and evaluation."""
    prefix = f"{start.iteration}/eto"
    trained = run.stage(f"{prefix}/policy", eto_stage, {"buffer": start.buffer, "start": start.policy})
    probe(run, prefix, run.path(trained.outputs["policy"]))
    evaluate(run, prefix, run.path(trained.outputs["policy"]))


@register_recipe("rerank", reads_critic=True)
def rerank(run: Run, start: Start) -> None:
    """Critic re-ranking, no policy update: the iteration's critic picks among sampled turns.

    Stages ``<iter>/rerank/eval_<split>`` only (the ``rerank`` section)."""
    evaluate(run, f"{start.iteration}/rerank", start.policy, start.critic)


def online_rounds(run: Run, start: Start, name: str, settings: OnlineRoundSettings, episodes_per_task: int,
                  label_round: Callable[[str, int, str], str]) -> str:
    """An online baseline's rounds from the starting policy; returns the last round's policy.

    Round r is ``<iter>/<name>/round_r/rollouts``: the current policy plays ``episodes_per_task`` sampled
    episodes of each task; then ``label_round(prefix, r, rollouts)``, the baseline's own stages, which
    return the round's labelled rollouts; then ``.../policy``: the PPO-clip update (pi_old = the round's
    acting policy, KL to the BC policy), which gives the next round's policy. Rounds run while
    ``settings.rounds`` allows and fewer than ``settings.env_steps`` environment steps were spent (a round
    is never cut: the budget is checked before each one, on the steps the earlier rounds' manifests
    record, so a resumed run stops where an uninterrupted one does).

    The first round whose steps, with the earlier rounds', reach a budget of
    ``settings.evaluate_at_env_steps`` has its policy probed and evaluated (``<iter>/<name>/round_r/probe``,
    ``.../eval_<split>``) before the next round starts; not the last round, whose policy the caller
    evaluates as ``<iter>/<name>``."""
    it = start.iteration
    policy, spent, r = start.policy, 0, 0
    pending = list(settings.evaluate_at_env_steps)
    while True:  # rounds >= 1 and env_steps >= 1: the first round always runs
        r += 1
        prefix = f"{it}/{name}/round_{r}"
        rollouts = run.stage(f"{prefix}/rollouts", online_rollouts_stage, {"policy": policy}, settings=settings,
                             episodes_per_task=episodes_per_task)
        steps = int(rollouts.metrics.get("env_steps", 0))
        spent += steps
        labelled = label_round(prefix, r, rollouts.outputs["trajectories"])
        updated = run.stage(f"{prefix}/policy", policy_stage, {"labelled": labelled, "start": policy},
                            policy=settings.policy, evaluated_as=f"{it}/{name}")
        policy = run.path(updated.outputs["policy"])
        if run.dry_run:  # no rollouts ran, so no steps count towards the budget
            limits = [f"{settings.env_steps} env steps ({name}.env_steps)" if settings.env_steps is not None else "",
                      f"{settings.rounds} rounds ({name}.rounds)" if settings.rounds is not None else ""]
            if settings.rounds != 1 or settings.env_steps is not None:
                run.log(f"[{it}/{name}] rounds until the budget: round_1's stages repeat as round_2, round_3, ... "
                        f"until {' or '.join(limit for limit in limits if limit) or 'the budget'}")
            return policy
        stalled = steps == 0 and settings.rounds is None  # nothing spent: the budget alone would never stop it
        last = stalled or (settings.rounds is not None and r >= settings.rounds) or \
            (settings.env_steps is not None and spent >= settings.env_steps)
        reached = [budget for budget in pending if budget <= spent]
        pending = [budget for budget in pending if budget > spent]
        if reached and not last:
            run.log(f"[{prefix}] {spent} env steps reach the budget{'s' if len(reached) > 1 else ''} "
                    f"{', '.join(map(str, reached))}: its policy is evaluated")
            probe(run, prefix, policy)
            evaluate(run, prefix, policy)
        if stalled:
            run.log(f"WARNING: [{prefix}] its rollouts took no environment step (every turn malformed?); "
                    f"{settings.method} stops here rather than spend rounds that the env_steps budget cannot count")
        if last:
            break
    run.log(f"[{it}/{name}] {r} rounds, {spent} env steps"
            + (f" (budget {settings.env_steps})" if settings.env_steps is not None else ""))
    if pending:
        run.log(f"[{it}/{name}] the rounds stopped before the budget{'s' if len(pending) > 1 else ''} "
                f"{', '.join(map(str, pending))} of evaluate_at_env_steps: no evaluation there")
    return policy


@register_recipe("grpo")
def grpo(run: Run, start: Start) -> None:
    """GRPO: online RL on its own rollouts with group-normalised returns, no critic.

    Rounds (:func:`online_rounds`) in which ``.../label`` gives every turn its episode's group advantage,
    then the last round's policy is probed and evaluated."""
    settings = run.config.grpo
    label = LabelConfig(estimator=settings.estimator, group_eps=settings.group_eps, gamma=settings.gamma,
                        gigpo_weight=settings.gigpo_weight, gigpo_norm=settings.gigpo_norm)

    def label_round(prefix: str, r: int, rollouts: str) -> str:
        return run.stage(f"{prefix}/label", group_label_stage, {"rollouts": rollouts}, label=label,
                         round_number=r).outputs["labelled"]

    policy = online_rounds(run, start, "grpo", settings, settings.group_size, label_round)
    probe(run, f"{start.iteration}/grpo", policy)
    evaluate(run, f"{start.iteration}/grpo", policy)


@register_recipe("ppo")
def ppo(run: Run, start: Start) -> None:
    """PPO: online RL on its own rollouts, GAE with a value head fitted round by round.

    Rounds (:func:`online_rounds`) in which ``.../value`` fits the value head (from the round before's) to
    the round's lambda-returns and writes V_old, the head before the fit, on every turn, and ``.../label``
    gives every turn its GAE advantage over r_env and V_old (the V the round acted with, as PPO's)."""
    settings = run.config.ppo
    heads: dict[int, str] = {}  # round -> its value stage's head (round r's value stage starts from r-1's)

    def label_round(prefix: str, r: int, rollouts: str) -> str:
        previous = heads.get(r - 1)
        inputs = {"rollouts": rollouts, "backbone": run.bc_policy,
                  **({"value": previous} if previous is not None else {})}
        valued = run.stage(f"{prefix}/value", value_stage, inputs, settings=settings, round_number=r)
        heads[r] = valued.outputs["value"]
        return run.stage(f"{prefix}/label", gae_label_stage, {"valued": valued.outputs["valued"]}, settings=settings,
                         round_number=r).outputs["labelled"]

    policy = online_rounds(run, start, "ppo", settings, settings.episodes_per_task, label_round)
    probe(run, f"{start.iteration}/ppo", policy)
    evaluate(run, f"{start.iteration}/ppo", policy)
