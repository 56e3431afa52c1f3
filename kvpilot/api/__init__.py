"""The InferenceService API: typed models, validation, the CRD generated from them, the engine codec
(`engine`: spec <-> `vllm serve` arguments, vLLM's defaults per GPU), how vLLM reads a command line
(`serve_args`: which flag each argument lands on) and the shared vocabulary.

This package is the bottom layer of kvpilot: it imports nothing else from kvpilot.
"""

from kvpilot.api.models import (
    Condition,
    EngineSpec,
    InferenceService,
    InferenceServiceSpec,
    InferenceServiceStatus,
    ObjectMeta,
    ResourcesSpec,
    RolloutSpec,
    SecretKeyRef,
    SLOSpec,
    TuningSpace,
    TuningSpec,
    TwinSpec,
)
from kvpilot.api.validation import (
    DocumentResult,
    InvalidInferenceService,
    ValidationIssue,
    load_documents,
    parse_inference_service,
    validate_object,
    validate_text,
)
from kvpilot.api.vocabulary import API_VERSION, GROUP, KIND, PLURAL, TUNED_ENGINE_FIELDS, VERSION

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "TUNED_ENGINE_FIELDS",
    "VERSION",
    "Condition",
    "DocumentResult",
    "EngineSpec",
    "InferenceService",
    "InferenceServiceSpec",
    "InferenceServiceStatus",
    "InvalidInferenceService",
    "ObjectMeta",
    "ResourcesSpec",
    "RolloutSpec",
    "SLOSpec",
    "SecretKeyRef",
    "TuningSpace",
    "TuningSpec",
    "TwinSpec",
    "ValidationIssue",
    "load_documents",
    "parse_inference_service",
    "validate_object",
    "validate_text",
]
