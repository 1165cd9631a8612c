"""Run configuration: one pydantic model per role, built from shared sub-models.

A run is described by one TOML file (see configs/ and docs/config.md). `decentrl run` resolves
it (with any `--set key=value`), writes the result as JSON into the run directory, and hands
that file to every role it starts; a role started by hand on another machine reads the same
file, or for a worker only needs the orchestrator URL and a token. Every field is declared once,
documented and constrained, so that a bad file fails at load time with the field's dotted name
and what is allowed.

One module per section, named after the role that reads it: model, task, prompt, store,
orchestrator (with [sampling]), worker, scorer, simulation (benchmarks only), trainer, logging (trackers),
placement (`decentrl run`'s GPUs);
run.py holds `RunConfig`,
load.py reading files and overrides. Import from this package.
"""

from decentrl.config.distill import DistillConfig
from decentrl.config.load import ConfigError, apply_overrides, load_config, parse_config, path_in_file
from decentrl.config.logging import LoggingConfig
from decentrl.config.model import ModelConfig, PretrainedModelConfig, TinyModelConfig, TinyMoEConfig
from decentrl.config.orchestrator import (
    AdvantageConfig,
    DelimiterStepsConfig,
    DynamicSamplingConfig,
    HedgingConfig,
    OrchestratorConfig,
    OverlongConfig,
    RewardConfig,
    SamplingConfig,
    StepsConfig,
    TreeConfig,
    TurnStepsConfig,
    VerificationConfig,
)
from decentrl.config.placement import Placed, PlacementConfig, RolePlacement
from decentrl.config.prompt import PromptConfig
from decentrl.config.roles import RolesConfig
from decentrl.config.run import RunConfig
from decentrl.config.scorer import (
    HFScorerConfig,
    JsonVerdictConfig,
    OpenAIScorerConfig,
    PythonScorerConfig,
    RegexVerdictConfig,
    ScorerConfig,
    TeacherScorerConfig,
)
from decentrl.config.simulation import SimulationConfig
from decentrl.config.store import StoreConfig
from decentrl.config.task import (
    AnswerConfig,
    ArithmeticTaskConfig,
    ChainTaskConfig,
    CountdownTaskConfig,
    DatasetTaskConfig,
    GuessTaskConfig,
    ImportTaskConfig,
    ProposeTaskConfig,
    ReasoningGymDatasetSpec,
    ReasoningGymTaskConfig,
    SortingTaskConfig,
    TaskConfig,
    VerifiersTaskConfig,
)
from decentrl.config.trainer import (
    CISPOObjectiveConfig,
    DrGRPOLossConfig,
    GRPOLossConfig,
    GSPOObjectiveConfig,
    IcePopConfig,
    LoRAConfig,
    LossConfig,
    ObjectiveConfig,
    OffPolicyConfig,
    PolicyLossBase,
    PPOObjectiveConfig,
    SeqMaskConfig,
    TISConfig,
    TokenLossConfig,
    TrainerAdvantagesConfig,
    TrainerConfig,
)
from decentrl.config.worker import OpenAIServerConfig, WorkerConfig

__all__ = [
    "AdvantageConfig", "AnswerConfig", "ArithmeticTaskConfig", "ChainTaskConfig", "CISPOObjectiveConfig", "ConfigError",
    "CountdownTaskConfig", "DatasetTaskConfig", "DelimiterStepsConfig", "DistillConfig", "DrGRPOLossConfig", "GRPOLossConfig",
    "DynamicSamplingConfig", "GSPOObjectiveConfig", "GuessTaskConfig", "HedgingConfig", "HFScorerConfig", "IcePopConfig",
    "ImportTaskConfig", "ProposeTaskConfig",
    "JsonVerdictConfig", "LoRAConfig", "LoggingConfig", "LossConfig", "ModelConfig", "ObjectiveConfig",
    "OffPolicyConfig", "OpenAIScorerConfig", "OpenAIServerConfig", "OrchestratorConfig", "OverlongConfig", "Placed", "PlacementConfig",
    "PPOObjectiveConfig", "PolicyLossBase", "PretrainedModelConfig", "PromptConfig", "PythonScorerConfig",
    "ReasoningGymDatasetSpec", "ReasoningGymTaskConfig", "RolesConfig", "RegexVerdictConfig", "RewardConfig", "RolePlacement",
    "RunConfig", "SamplingConfig", "ScorerConfig", "SeqMaskConfig", "SimulationConfig", "SortingTaskConfig",
    "StepsConfig", "StoreConfig", "TISConfig", "TaskConfig", "TeacherScorerConfig", "TinyModelConfig", "TinyMoEConfig", "TokenLossConfig",
    "TrainerAdvantagesConfig", "TrainerConfig", "TreeConfig", "TurnStepsConfig", "VerificationConfig", "VerifiersTaskConfig",
    "WorkerConfig", "apply_overrides", "load_config", "parse_config", "path_in_file",
]
