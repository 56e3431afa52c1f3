"""Kubernetes' own rules for the strings an InferenceService hands to it.

What the API server or the kubelet would refuse later (a Secret name that is not a DNS subdomain,
an extended resource name without a domain, a quantity `resource.ParseQuantity` rejects, an image
reference the container runtime cannot pull) is refused here, when the user can still fix it.
Each rule is a regular expression that goes into the CRD's schema as `pattern` (so the API server
checks it too) plus, where a pattern cannot say it, a check in Python with the same meaning.
The expressions use only the syntax Go's RE2 and Rust's regex (pydantic's) share.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated

from pydantic import AfterValidator, Field
from pydantic_core import PydanticCustomError

# k8s.io/apimachinery/pkg/util/validation: IsDNS1123Subdomain (Secret and ConfigMap names).
DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN_PATTERN = rf"^{DNS1123_LABEL}(\.{DNS1123_LABEL})*$"
# IsConfigMapKey: the keys of a Secret's data.
CONFIG_MAP_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# IsQualifiedName with a mandatory prefix: `domain/name`; IsExtendedResourceName adds that the
# domain is not kubernetes.io (those are the native resources).
_QUALIFIED_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
EXTENDED_RESOURCE_PATTERN = rf"^{DNS1123_LABEL}(\.{DNS1123_LABEL})*/{_QUALIFIED_NAME}$"

# IsValidLabelValue: at most 63 characters, alphanumerics with '-', '_' and '.' inside (a node
# label's value, such as nvidia.com/gpu.product's NVIDIA-H100-80GB-HBM3).
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"

# IsQualifiedName: an optional DNS-subdomain prefix (at most 253) and a slash, then a name of at most 63.
LABEL_NAME_PATTERN = rf"^{_QUALIFIED_NAME}$"


def label_key_problem(key: str) -> str | None:
    """Why `key` is not a Kubernetes label key (IsQualifiedName), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not re.match(DNS1123_SUBDOMAIN_PATTERN, prefix)):
        return f"label key {key!r}: the prefix before '/' must be a DNS subdomain of at most 253 characters"
    if not name or len(name) > 63 or not re.match(LABEL_NAME_PATTERN, name):
        return (f"label key {key!r}: the name must be 1-63 characters, alphanumerics with '-', '_' or '.' "
                "inside")
    return None


def label_value_problem(value: str) -> str | None:
    """Why `value` is not a Kubernetes label value (IsValidLabelValue), or None."""
    if len(value) > 63 or not re.match(LABEL_VALUE_PATTERN, value):
        return (f"label value {value!r}: at most 63 characters, alphanumerics with '-', '_' or '.' inside, "
                "or empty")
    return None


# resource.ParseQuantity: <sign><digits>[.<digits>][<binarySI>|<decimalSI>|e<exponent>].
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

# github.com/distribution/reference's grammar (what containerd and CRI-O parse an image with).
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"([._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}({_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"([a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"({_DOMAIN_COMPONENT}(\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(:[0-9]+)?"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
IMAGE_PATTERN = rf"^({_DOMAIN}/)?{_PATH_COMPONENT}(/{_PATH_COMPONENT})*(:{_TAG})?(@{_DIGEST})?$"
IMAGE_MAX_LENGTH = 255 + 1 + 128 + 1 + 135  # name, tag and a sha512 digest

_QUANTITY = re.compile(QUANTITY_PATTERN[1:-1])
PIB = 1 << 50


def _rule(message: str) -> PydanticCustomError:
    return PydanticCustomError("kvpilot_rule", "{rule}", {"rule": message})


def parse_quantity(text: str) -> Decimal:
    """The value of a Kubernetes quantity (`32Gi` -> 34359738368), as resource.ParseQuantity reads it.

    ValueError for text that is not a quantity."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a Kubernetes quantity")
    number = text[: match.start(3)] if match.group(3) else text
    suffix = match.group(3) or ""
    try:
        value = Decimal(number)
    except InvalidOperation:  # pragma: no cover - the pattern admits only decimal numbers
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from None
    if suffix in _BINARY:
        return value * (1 << _BINARY[suffix])
    if suffix in _DECIMAL:
        return value.scaleb(_DECIMAL[suffix])
    exponent = int(suffix[1:])
    if abs(exponent) > 64:  # far past any resource; keeps Decimal arithmetic small
        return value.scaleb(64 if exponent > 0 else -64) if value else value
    return value.scaleb(exponent)


def _bytes_quantity(text: str) -> str:
    value = parse_quantity(text)
    if value <= 0:
        raise _rule(f"must be a positive number of bytes (got {text!r})")
    if value != value.to_integral_value():
        raise _rule(
            f"must be a whole number of bytes (got {text!r}; 'm' means thousandths, so 1m is a "
            "thousandth of a byte: did you mean Mi?)"
        )
    if value > PIB:
        raise _rule(f"must be at most 1Pi (got {text!r})")
    return text


def _cpu_quantity(text: str) -> str:
    value = parse_quantity(text)
    if value < Decimal("0.001"):
        raise _rule(f"must be at least 1m (a thousandth of a core) (got {text!r})")
    if value > 4096:
        raise _rule(f"must be at most 4096 cores (got {text!r})")
    return text


def _extended_resource(text: str) -> str:
    domain, _, name = text.partition("/")
    if len(domain) > 253 or len(name) > 63:
        raise _rule(f"the domain may have at most 253 characters and the name 63 (got {text!r})")
    if domain == "kubernetes.io" or domain.endswith(".kubernetes.io"):
        raise _rule(f"must be an extended resource such as nvidia.com/gpu, not one in kubernetes.io (got {text!r})")
    return text


def _image(text: str) -> str:
    name = text.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    repository = name[:colon] if colon > slash else name
    if len(repository) > 255:
        raise _rule(f"the repository name may have at most 255 characters (got {len(repository)})")
    return text


ByteQuantity = Annotated[
    str,
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    AfterValidator(_bytes_quantity),
]
CpuQuantity = Annotated[
    str,
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    AfterValidator(_cpu_quantity),
]
SecretName = Annotated[
    str,
    Field(min_length=1, max_length=253, pattern=DNS1123_SUBDOMAIN_PATTERN),
]
SecretKey = Annotated[
    str,
    Field(min_length=1, max_length=253, pattern=CONFIG_MAP_KEY_PATTERN),
]
ConfigMapName = SecretName
ConfigMapKey = SecretKey
LabelValue = Annotated[
    str,
    Field(min_length=1, max_length=63, pattern=LABEL_VALUE_PATTERN),
]
ExtendedResourceName = Annotated[
    str,
    Field(min_length=3, max_length=317, pattern=EXTENDED_RESOURCE_PATTERN),
    AfterValidator(_extended_resource),
]
ImageReference = Annotated[
    str,
    Field(min_length=1, max_length=IMAGE_MAX_LENGTH, pattern=IMAGE_PATTERN),
    AfterValidator(_image),
]

# The messages that say what a pattern means, keyed by pattern (validation.py reads them back,
# so a pattern mismatch reads "must be a DNS-1123 subdomain ..." rather than a regular expression).
PATTERN_MESSAGES: dict[str, str] = {
    QUANTITY_PATTERN: "must be a Kubernetes quantity, e.g. 32Gi, 8 or 500m",
    DNS1123_SUBDOMAIN_PATTERN: "must be a DNS-1123 subdomain: lower-case letters, digits, '-' and '.', "
    "starting and ending with a letter or digit (e.g. hf-token)",
    CONFIG_MAP_KEY_PATTERN: "must be a Secret key: letters, digits, '-', '_' and '.' (e.g. HF_TOKEN)",
    LABEL_VALUE_PATTERN: "must be a Kubernetes label value: letters, digits, '-', '_' and '.', starting and "
    "ending with a letter or digit (e.g. NVIDIA-H100-80GB-HBM3)",
    EXTENDED_RESOURCE_PATTERN: "must be an extended resource name, domain/name (e.g. nvidia.com/gpu)",
    IMAGE_PATTERN: "must be a container image reference, [registry/]repository[:tag][@digest] in lower case "
    "without spaces (e.g. vllm/vllm-openai:v0.33.0)",
}
