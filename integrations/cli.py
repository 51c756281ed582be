"""``python -m gradhealth.integrations.cli fit --config configs/default.yaml``: LightningCLI over the
demo module and synthetic data, with ``GradHealthCallback`` configured from YAML."""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

from gradhealth.demos.lightning_parts import DemoModule, SyntheticData


def main(args=None, run: bool = True) -> LightningCLI:
    return LightningCLI(DemoModule, SyntheticData, args=args, run=run, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
