#!/bin/bash
# A node's environment, built in its workdir by `spotring run` (launch/node_env.py says
# when): .venv on top of the image's Python, whose packages stay visible underneath (what
# the image has, such as torch, is not installed again); spotring from the launcher's own
# wheel in .spotring/; the project's requirements (this script's arguments, as pip takes
# them); Horovod, built where the job needs it and the image lacks it. .venv/.spotring-env
# then holds the key of what was built: a node that holds the same key does nothing here,
# and a replacement node gets a copy of a built .venv instead of running this.
#
#   SPOTRING_ENV_KEY=K SPOTRING_IMAGE_PYTHON=python3 SPOTRING_EXTRAS=mpi \
#   SPOTRING_HOROVOD=1 bash .spotring/node/setup.sh -r requirements.txt
set -euo pipefail
key=$SPOTRING_ENV_KEY
image=$SPOTRING_IMAGE_PYTHON
if [ "$(cat .venv/.spotring-env 2> /dev/null)" = "$key" ]; then
    echo "spotring setup: the environment $key is here"
    exit 0
fi
rm -rf .venv
"$image" -m venv --without-pip .venv
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Every packages directory the image's Python sees, also those its own .pth files add.
"$image" -c 'import sys; print("\n".join(p for p in sys.path
    if p.endswith(("site-packages", "dist-packages"))))' > "$site/spotring-image.pth"
# pip from the image where it has one (no second setuptools to shadow the image's).
.venv/bin/python -m pip --version > /dev/null 2>&1 || .venv/bin/python -m ensurepip > /dev/null
# The launchers the job starts, where it looks for them (.venv/bin): from the image's
# scripts directory, or from that of an environment it layers on.
bins=$("$image" -c 'import pathlib, sys, sysconfig; print("\n".join(dict.fromkeys(
    [sysconfig.get_paths()["scripts"]] + [str(pathlib.Path(p).parents[2] / "bin")
    for p in sys.path if p.endswith("site-packages")])))')
for name in torchrun horovodrun mpirun mpiexec prte prted prterun orted ompi_info; do
    for dir in $bins; do
        if [ -x "$dir/$name" ] && [ ! -e ".venv/bin/$name" ]; then
            ln -s "$dir/$name" ".venv/bin/$name"
        fi
    done
done
pip=(.venv/bin/python -m pip --disable-pip-version-check install --progress-bar off)
wheel=$(ls .spotring/spotring-*.whl)
# Over whatever spotring the image holds (outside .venv: pip leaves that one alone).
"${pip[@]}" --no-deps --force-reinstall "$wheel"
"${pip[@]}" "$wheel${SPOTRING_EXTRAS:+[$SPOTRING_EXTRAS]}" "$@"
if [ "${SPOTRING_HOROVOD:-0}" = 1 ] && ! .venv/bin/python -c 'import horovod.torch' 2> /dev/null
then
    chmod +x .spotring/node/build-horovod .spotring/node/cxx20
    ops=cpu
    if command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1; then ops=NCCL; fi
    HOROVOD_GPU_OPERATIONS=$ops .spotring/node/build-horovod .venv
fi
echo "$key" > .venv/.spotring-env
echo "spotring setup: built the environment $key"
