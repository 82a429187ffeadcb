"""Validate a Kubernetes object against a CustomResourceDefinition's openAPIV3Schema, strictly.

The API server prunes fields a CRD's structural schema does not declare, silently: a misspelt
`resourcesPerNod` would vanish and the job run without GPUs. So here an undeclared field is an
error, everywhere except under `x-kubernetes-preserve-unknown-fields`. The OpenAPI schema becomes
a JSON schema for `jsonschema`:

- objects with declared properties get `additionalProperties: false`; an object that declares
  neither properties nor additionalProperties holds nothing (the server would prune all of it);
- `x-kubernetes-int-or-string` becomes anyOf integer / string, `nullable` adds "null";
- the root `metadata` (which a CRD leaves to the API server) is checked as the ObjectMeta subset
  an export may write: name, namespace, labels, annotations.

CEL rules (`x-kubernetes-validations`) are not evaluated; `cel_rules(crd)` lists them so a test
can check the ones that concern what it writes.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

_DNS_SUBDOMAIN = r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_DNS_LABEL = r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": _DNS_SUBDOMAIN},
                   "namespace": {"type": "string", "pattern": _DNS_LABEL},
                   "labels": _STRING_MAP, "annotations": _STRING_MAP},
    "required": ["name"],
    "additionalProperties": False,
}


def load_crd(path: str | Path) -> dict:
    return yaml.safe_load(Path(path).read_text())


def strict_schema(node: Any) -> Any:
    """The JSON schema for one OpenAPI v3 schema node of a CRD (see module docstring)."""
    if not isinstance(node, dict):
        return node
    out: dict = {}
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("description", "format", "default",
                                                      "example"):
            continue
        if key == "properties":
            out[key] = {k: strict_schema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = strict_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [strict_schema(v) for v in value]
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
        # a pattern in an int-or-string applies to the string form only (as in JSON schema)
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
        out.pop("nullable", None)
    out.pop("nullable", None)
    if out.get("type") == "object" and not preserve and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def version_schema(crd: dict, api_version: str) -> dict:
    """The strict JSON schema of the CRD version that `api_version` names."""
    group = crd["spec"]["group"]
    served = {f"{group}/{v['name']}": v for v in crd["spec"]["versions"]}
    if api_version not in served:
        raise KeyError(f"apiVersion {api_version!r}: the CRD serves {sorted(served)}")
    schema = strict_schema(served[api_version]["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind",
                                                                    "metadata", "spec"})
    return schema


def errors(doc: dict, crd: dict) -> list[str]:
    """Every way `doc` fails the CRD: wrong apiVersion or kind, undeclared fields, wrong types,
    missing required fields. Each message names the path, e.g. `spec.trainer.numNodes: ...`."""
    out = []
    kind = crd["spec"]["names"]["kind"]
    if not isinstance(doc, dict):
        return [f"expected a mapping, got {type(doc).__name__}"]
    if doc.get("kind") != kind:
        out.append(f"kind: got {doc.get('kind')!r}; the CRD defines {kind!r}")
    try:
        schema = version_schema(crd, str(doc.get("apiVersion")))
    except KeyError as e:
        return out + [str(e.args[0])]
    validator = jsonschema.Draft7Validator(schema)
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "(root)"
        out.append(f"{where}: {err.message}")
    return out


def cel_rules(crd: dict) -> Iterator[tuple[str, str]]:
    """(property path, CEL rule) of every x-kubernetes-validations entry, for reference."""
    def walk(node: Any, path: str) -> Iterator[tuple[str, str]]:
        if not isinstance(node, dict):
            return
        for rule in node.get("x-kubernetes-validations") or []:
            yield path, rule["rule"]
        for k, v in (node.get("properties") or {}).items():
            yield from walk(v, f"{path}.{k}" if path else k)
        if isinstance(node.get("items"), dict):
            yield from walk(node["items"], path + "[]")
    for v in crd["spec"]["versions"]:
        yield from walk(v["schema"]["openAPIV3Schema"], "")
