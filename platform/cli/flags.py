"""The CLI's flags, generated from the `Settings` fields: one flag per field, help that names the default and the
environment variable, and per sub-command the groups it needs. Nothing here states a default or a help text."""

from __future__ import annotations

import argparse
import dataclasses

from tinkerflow.common.settings import ENV_ONLY, GROUP_TITLES, Settings, config_fields, env_names

# Flags that are no Settings field, on purpose: what a command does rather than how the service is configured.
NOT_SETTINGS = {
    "--ready-file": "internal: touched when the part is ready; `up` passes it to its children",
    "--keep-up": "`up -- CMD`: stay up after CMD exits",
    "--with-stack": "`ray`: also run Temporal, the workflow worker and the API on the driver's node",
    "--seed": "`make-tiny-model`: the weights' seed",
    "--family": "`make-tiny-model`: which model family's tiny checkpoint",
    "--vision": "`make-tiny-model`: the family's vision-language tiny checkpoint",
    "--days": "`usage`: the last N UTC days",
    "--prices": "`usage`: a price table to estimate costs with",
    "-h": "argparse's own help",
    "--help": "argparse's own help",
}


def flag_name(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _shown_default(f: dataclasses.Field) -> str:
    if f.metadata["shown"] is not None:
        return f.metadata["shown"]
    default = f.metadata["default"]
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return repr(default) if isinstance(default, str) else str(default)


def _help(f: dataclasses.Field) -> str:
    envs = " or ".join(("$" + name if i else name) for i, name in enumerate(env_names(f)))
    text = f"{f.metadata['help']} (default: {_shown_default(f)}; env {envs})"
    return text.replace("%", "%%")  # argparse formats help with %


def add_settings_flags(parser: argparse.ArgumentParser, groups: tuple[str, ...]) -> None:
    """One argument group per Settings group, in the order given; every flag defaults to None, so
    `Settings.with_args` overlays only what the user typed."""
    fields = list(config_fields())
    for group in groups:
        if group in ENV_ONLY:
            raise ValueError(f"the {group} settings have no flags")
        g = parser.add_argument_group(GROUP_TITLES[group])
        for f in (f for f in fields if f.metadata["group"] == group):
            g.add_argument(flag_name(f), *f.metadata["aliases"], dest=f.name, default=None, help=_help(f), **_kind(f))


def _kind(f: dataclasses.Field) -> dict:
    default = f.metadata["default"]
    kwargs: dict = {}
    if f.metadata["choices"]:
        kwargs["choices"] = f.metadata["choices"]
    if isinstance(default, bool):
        return {"action": argparse.BooleanOptionalAction}
    if isinstance(default, tuple):
        return {"action": "append", "metavar": f.metadata["metavar"] or "KEY[,KEY...]"}
    if isinstance(default, (int, float)):
        kwargs["type"] = type(default)
        kwargs["metavar"] = f.metadata["metavar"] or "N"
    elif f.metadata["metavar"]:
        kwargs["metavar"] = f.metadata["metavar"]
    return kwargs


def settings_from(args: argparse.Namespace) -> Settings:
    """The environment and the defaults, overlaid with the flags given (flags win)."""
    return Settings().with_args(args)
