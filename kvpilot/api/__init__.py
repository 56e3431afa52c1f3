"""The InferenceService API: typed models, validation, and the CRD generated from them.

This package is the bottom layer of kvpilot: it imports nothing else from kvpilot.
"""

from kvpilot.api.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    TUNED_ENGINE_FIELDS,
    VERSION,
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
