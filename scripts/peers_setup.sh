#!/usr/bin/env bash
# On the GPU machine (no registry), or a CPU one: make the peers importable from the sdists/wheel carried in .peers/.
#   source scripts/peers_setup.sh            -> unpacks, sets PYTHONPATH (Triton ops of mamba_ssm usable at once)
#   PEERS_BUILD_CUDA=1 source scripts/peers_setup.sh
#                                            -> also compiles selective_scan_cuda and causal_conv1d_cuda for sm_90
#                                               in the background (logs in /tmp/peers/build-*.log; ~2-6 min)
# Nothing of the peers is committed; adapters import them when present.
P=/tmp/peers
mkdir -p $P/site $P/ext
for f in .peers/*.tar.gz; do [ -e "$f" ] && tar xzf "$f" -C $P; done
if ls .peers/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target $P/site .peers/*.whl 2>/dev/null || true
fi
_PEER_MS=$(ls -d $P/mamba_ssm-*/ | head -1); _PEER_CC=$(ls -d $P/causal_conv1d-*/ | head -1)
# the built CUDA extensions only where there is a GPU (on a CPU machine they fail to load, libc10_cuda missing,
# and mamba_ssm's Triton ops run under Triton's interpreter with the placeholder selective_scan_cuda instead)
_PEER_EXT=""; command -v nvidia-smi >/dev/null 2>&1 && _PEER_EXT="$P/ext:"
export PYTHONPATH="$PWD:$P/site:$_PEER_EXT${_PEER_MS%/}:${_PEER_CC%/}:${PYTHONPATH:-}"
# extensions built before (scripts/gpu.sh leaves them gzipped in <logs>/ext/; keep them in .peers/ext)
if [ -n "$_PEER_EXT" ]; then
  for f in .peers/ext/*.so.gz; do [ -e "$f" ] && gunzip -c "$f" > $P/ext/$(basename "${f%.gz}"); done
fi
[ -d .peers/src ] && export PYTHONPATH="$PWD/.peers/src:$PYTHONPATH"
export HARNESS_PEERS_STUB_CUDA=1   # adapters install a placeholder selective_scan_cuda until the real one is built
if [ "${PEERS_BUILD_CUDA:-0}" = 1 ] && ! ls $P/ext/*.so >/dev/null 2>&1; then
  ( cd $P && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 "$OLDPWD/scripts/build_peer_ext.py" selective_scan "$_PEER_MS" $P/ext > $P/build-selective_scan.log 2>&1 ) &
  ( cd $P && TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 python3 "$OLDPWD/scripts/build_peer_ext.py" causal_conv1d "$_PEER_CC" $P/ext > $P/build-causal_conv1d.log 2>&1 ) &
fi
