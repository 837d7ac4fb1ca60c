# Sourced by the engines' environment scripts (vllm_venv.sh, sglang_venv.sh): step runs a command with
# its output appended to $LOG, shown (less pip's index warnings) only when it fails, naming $SCRIPT.
step() {
    if ! "$@" >>"$LOG" 2>&1; then
        echo "$SCRIPT: failed: $*" >&2
        grep -v "^WARNING: Location" "$LOG" | tail -40 >&2
        exit 1
    fi
}

# pip's editable install of the project, one at a time: both engines' environments may be built at
# once (make test builds them together), and setuptools writes weightstream.egg-info in the checkout.
editable_install() {
    mkdir -p build
    flock build/editable-install.lock "$@" install -e .
}
