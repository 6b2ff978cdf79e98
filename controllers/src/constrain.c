/* constrain: constrained generation configured by controller_arg (see controllers/README.md):
 *   {"regex": ...} | {"json_schema": ...} | {"grammar": ..., "syntax": "lark"|"yacc"} | {"choices": [...]}
 *   plus optional "stop": str|[str], "max_tokens": n and "fast_forward": bool (splice the tokens the grammar
 *   forces, two or more, instead of sampling them one step each; not with stop strings).
 * Masks come from the host's llguidance constraints; the sequence stops when the constraint is finished, a stop
 * string appears, max_tokens tokens were generated or EOS is sampled. */
#include "aici.h"

static aici_gen gen;
static int failed;

static const char *const KEYS[] = {"regex", "rx", "json_schema", "yacc", "lark", "grammar", "syntax", "choices",
                                   "options", "stop", "stop_at", "max_tokens", "fast_forward", NULL};

/* 1 and the key when spec (an object) has a member constrain does not know: a typo must not pass silently. */
static int unknown_key(aici_json spec, aici_json *key) {
    aici_json_iter it = {0};
    aici_json val;
    while (aici_json_next(spec, &it, key, &val)) {
        int known = 0;
        for (const char *const *k = KEYS; *k && !known; k++) known = aici_json_str_eq(*key, *k);
        if (!known) return 1;
    }
    return 0;
}

static void init_prompt(const uint32_t *prompt, uint32_t n) {
    uint32_t len;
    char *arg = (char *)aici_read_blob(aici_host_module_arg(), &len);
    aici_json spec, key;
    const char *err = "controller_arg must be a JSON object";
    int ok = aici_json_parse(arg, len, &spec);
    if (ok && aici_json_type(spec) == AICI_J_OBJECT && unknown_key(spec, &key)) {
        aici_logs("constrain: bad controller_arg: unknown key ");
        aici_log(key.p, key.n);
        aici_logs("\n");
        failed = 1;
        aici_host_stop();
    }
    if (!ok || !aici_gen_init(&gen, spec, &err)) {
        aici_logs("constrain: bad controller_arg: ");
        aici_logs(err);
        aici_logs("\n");
        failed = 1;
        aici_host_stop();
    }
    /* gen keeps spans into arg only during init; the strings it needs were copied */
    free(arg);
    aici_gen_declare(&gen);   /* the host may compute the mask and commit the tokens without calling */
}

static aici_mid_result mid_process(const uint32_t *fork_group, uint32_t n) {
    aici_mid_result r = aici_gen_mid(&gen);
    aici_gen_declare(&gen);
    return r;
}

static int post_process(const uint32_t *tokens, uint32_t n, uint32_t backtrack) {
    int stop = aici_gen_post(&gen, tokens, n);
    aici_gen_declare(&gen);
    return stop;
}

static const aici_ctrl ctrl = {init_prompt, NULL, mid_process, post_process};
const aici_ctrl *aici_controller(void) { return &ctrl; }
