"""A minimal JSON schema of KubeRay's `ray.io/v1` RayJob, written by hand from the fields of the KubeRay v1 CRDs
(rayjobs.ray.io, with the RayCluster spec it embeds): no package in the registries ships those CRDs. It lists every
field those CRDs define at the levels we write (so a misspelt or misplaced field fails), with the types and enums
we rely on; pod templates below it are core PodTemplateSpecs, which tests/infra/test_k8s_ray.py validates strictly
with kubernetes-validate instead."""

from __future__ import annotations

STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}},
    "additionalProperties": False,
}

HEAD_GROUP = {
    "type": "object",
    "required": ["template"],
    "additionalProperties": False,
    "properties": {
        "enableIngress": {"type": "boolean"},
        "headService": {"type": "object"},
        "rayStartParams": STRING_MAP,
        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
        "template": POD_TEMPLATE,
    },
}

WORKER_GROUP = {
    "type": "object",
    "required": ["groupName", "template"],
    "additionalProperties": False,
    "properties": {
        "groupName": {"type": "string", "minLength": 1},
        "idleTimeoutSeconds": {"type": "integer"},
        "maxReplicas": {"type": "integer", "minimum": 0},
        "minReplicas": {"type": "integer", "minimum": 0},
        "numOfHosts": {"type": "integer", "minimum": 1},
        "rayStartParams": STRING_MAP,
        "replicas": {"type": "integer", "minimum": 0},
        "scaleStrategy": {"type": "object"},
        "suspend": {"type": "boolean"},
        "template": POD_TEMPLATE,
    },
}

RAY_CLUSTER_SPEC = {
    "type": "object",
    "required": ["headGroupSpec"],
    "additionalProperties": False,
    "properties": {
        "autoscalerOptions": {"type": "object"},
        "enableInTreeAutoscaling": {"type": "boolean"},
        "gcsFaultToleranceOptions": {"type": "object"},
        "headGroupSpec": HEAD_GROUP,
        "headServiceAnnotations": STRING_MAP,
        "managedBy": {"type": "string"},
        "rayVersion": {"type": "string"},
        "suspend": {"type": "boolean"},
        "workerGroupSpecs": {"type": "array", "items": WORKER_GROUP},
    },
}

RAYJOB = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "activeDeadlineSeconds": {"type": "integer"},
                "backoffLimit": {"type": "integer"},
                "clusterSelector": STRING_MAP,
                "deletionStrategy": {"type": "object"},
                "entrypoint": {"type": "string"},
                "entrypointNumCpus": {"type": "number"},
                "entrypointNumGpus": {"type": "number"},
                "entrypointResources": {"type": "string"},
                "jobId": {"type": "string"},
                "managedBy": {"type": "string"},
                "metadata": STRING_MAP,
                "rayClusterSpec": RAY_CLUSTER_SPEC,
                "runtimeEnvYAML": {"type": "string"},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                "submitterConfig": {"type": "object"},
                "submitterPodTemplate": POD_TEMPLATE,
                "suspend": {"type": "boolean"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
            },
        },
    },
}
