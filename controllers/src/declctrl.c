/* declctrl: a declarative program controller in the spirit of AICI's declctrl. controller_arg is
 * {"steps": [step...]}, each step an object with one key (full format in controllers/README.md):
 *   {"Fixed": {"text": str}}                          force text ({{var}} expands a variable)
 *   {"Gen": {"rx"|"regex"|"json_schema"|"grammar"(+"syntax")|"yacc"|"lark": ..., "max_tokens": n,
 *            "stop_at": str, "set_var": name, "fast_forward": bool}}   generate (optionally constrained), store
 *                                                     the text (fast_forward: as in constrain)
 *   {"Choose": {"options": [str...], "set_var": name}} generate exactly one of the options
 *   {"Fork": {"branches": [[step...], ...]}}           fork; branch i runs in fork i, then the steps after Fork
 *   {"Wait": {"vars": [name...], "max_steps": n}}     suspend until every variable is set (fail after n
 *                                                     suspended steps, default 1000)
 *   {"Set": {"var": name, "value": str, "append": bool}}
 *   {"Stop": {}}
 * Any step body may carry "label": name (the token position where that step ended is remembered); a Fixed with
 * "following": name backtracks everything generated after that step before inserting its text (labels of the
 * removed steps are forgotten).
 */
#include "aici.h"

enum { K_END, K_FIXED, K_GEN, K_CHOOSE, K_FORK, K_WAIT, K_SET, K_STOP, K_BAD };
static const char *const KIND_NAMES[] = {"", "Fixed", "Gen", "Choose", "Fork", "Wait", "Set", "Stop"};

#define MAX_FRAMES 32
typedef struct { aici_json steps; uint32_t idx; } frame;

static char *arg_text;   /* controller_arg; every aici_json below points into it */
static frame frames[MAX_FRAMES];
static uint32_t n_frames;
static int fork_pending, gen_active;
static uint64_t wait_steps;          /* steps suspended in the current Wait */
static uint32_t pending_backtrack;   /* an EOS that ended a Gen, removed with the next splice */
static aici_gen gen;
static aici_json gen_body;
static uint32_t *ff;

__attribute__((noreturn)) static void fail(const char *what, const char *detail) {
    aici_logs("declctrl: ");
    aici_logs(what);
    if (detail) {
        aici_logs(": ");
        aici_logs(detail);
    }
    aici_logs("\n");
    aici_host_stop();
}

#define MAX_LABELS 32
static char *label_names[MAX_LABELS];
static uint32_t label_pos[MAX_LABELS], n_labels;

static int label_index(const char *name) {
    for (uint32_t i = 0; i < n_labels; i++)
        if (strlen(label_names[i]) == strlen(name) && memcmp(label_names[i], name, strlen(name)) == 0) return (int)i;
    return -1;
}

/* Remembers where the step with this body ended (token count). */
static void set_label(aici_json body, uint32_t pos) {
    aici_json v;
    if (!aici_json_get(body, "label", &v)) return;
    char *name = aici_json_str(v, NULL);
    int i = label_index(name);
    if (i >= 0) {
        label_pos[i] = pos;
        free(name);
        return;
    }
    if (n_labels == MAX_LABELS) fail("too many labels", NULL);
    label_names[n_labels] = name;
    label_pos[n_labels++] = pos;
}

/* Labels of steps whose text a backtrack removed are forgotten. */
static void drop_labels_after(uint32_t pos) {
    uint32_t j = 0;
    for (uint32_t i = 0; i < n_labels; i++) {
        if (label_pos[i] > pos) {
            free(label_names[i]);
            continue;
        }
        label_names[j] = label_names[i];
        label_pos[j++] = label_pos[i];
    }
    n_labels = j;
}


static int step_kind(aici_json step, aici_json *body) {
    aici_json_iter it = {0};
    aici_json key;
    if (aici_json_type(step) != AICI_J_OBJECT || !aici_json_next(step, &it, &key, body)) return K_BAD;
    for (int k = K_FIXED; k < K_BAD; k++)
        if (aici_json_str_eq(key, KIND_NAMES[k])) return aici_json_type(*body) == AICI_J_OBJECT ? k : K_BAD;
    return K_BAD;
}

static int nth(aici_json arr, uint32_t i, aici_json *out) {
    aici_json_iter it = {0};
    while (aici_json_next(arr, &it, NULL, out))
        if (i-- == 0) return 1;
    return 0;
}

/* Checks a step list recursively; fails naming the first problem. */
static void validate(aici_json steps, int depth) {
    if (aici_json_type(steps) != AICI_J_ARRAY) fail("steps must be an array", NULL);
    if (depth > 8) fail("forks nested too deeply", NULL);
    aici_json_iter it = {0};
    aici_json step, body, v, b;
    while (aici_json_next(steps, &it, NULL, &step)) {
        int kind = step_kind(step, &body);
        if (kind != K_BAD && aici_json_get(body, "label", &v) && aici_json_type(v) != AICI_J_STRING)
            fail("label must be a string", NULL);
        switch (kind) {
        case K_BAD:
            fail("unknown or malformed step (expected {\"Fixed\"|\"Gen\"|\"Choose\"|\"Fork\"|\"Wait\"|"
                        "\"Set\"|\"Stop\": {...}})", NULL);
        case K_FIXED:
            if (!aici_json_get(body, "text", &v) || aici_json_type(v) != AICI_J_STRING)
                fail("Fixed needs \"text\": string", NULL);
            if (aici_json_get(body, "following", &v) && aici_json_type(v) != AICI_J_STRING)
                fail("following must be a label name", NULL);
            break;
        case K_CHOOSE:
            if (!aici_json_get(body, "options", &v) || aici_json_type(v) != AICI_J_ARRAY || !aici_json_len(v))
                fail("Choose needs \"options\": [string, ...]", NULL);
            break;
        case K_FORK: {
            if (!aici_json_get(body, "branches", &v) || aici_json_type(v) != AICI_J_ARRAY || !aici_json_len(v))
                fail("Fork needs \"branches\": [[step, ...], ...]", NULL);
            aici_json_iter bi = {0};
            while (aici_json_next(v, &bi, NULL, &b)) validate(b, depth + 1);
            break;
        }
        case K_WAIT:
            if (!aici_json_get(body, "vars", &v) || aici_json_type(v) != AICI_J_ARRAY)
                fail("Wait needs \"vars\": [name, ...]", NULL);
            int64_t ms;
            if (aici_json_get(body, "max_steps", &v) && (!aici_json_int(v, &ms) || ms < 0))
                fail("Wait max_steps must be a non-negative integer", NULL);
            break;
        case K_SET:
            if (!aici_json_get(body, "var", &v) || aici_json_type(v) != AICI_J_STRING ||
                !aici_json_get(body, "value", &v) || aici_json_type(v) != AICI_J_STRING)
                fail("Set needs \"var\" and \"value\" strings", NULL);
            break;
        default:
            break;
        }
    }
}

/* Text with every {{name}} replaced by the variable's value (empty if unset). */
static char *expand(aici_json v, uint32_t *len) {
    uint32_t n;
    char *s = aici_json_str(v, &n);
    aici_buf b = {0};
    aici_buf_put(&b, "", 0);
    for (uint32_t i = 0; i < n; i++) {
        if (s[i] == '{' && i + 1 < n && s[i + 1] == '{') {
            uint32_t j = i + 2;
            while (j + 1 < n && !(s[j] == '}' && s[j + 1] == '}')) j++;
            if (j + 1 < n) {
                char *name = aici_strndup(s + i + 2, j - i - 2);
                uint32_t vl = 0;
                char *val = aici_var_get(name, &vl, NULL);
                if (val) aici_buf_put(&b, val, vl);
                free(val);
                free(name);
                i = j + 1;
                continue;
            }
        }
        aici_buf_putc(&b, s[i]);
    }
    free(s);
    *len = b.n;
    return b.p;
}

static char *str_field(aici_json body, const char *key) {
    aici_json v;
    return aici_json_get(body, key, &v) ? aici_json_str(v, NULL) : NULL;
}

static int vars_ready(aici_json body) {
    aici_json names, name;
    aici_json_get(body, "vars", &names);
    aici_json_iter it = {0};
    while (aici_json_next(names, &it, NULL, &name)) {
        char *s = aici_json_str(name, NULL);
        char *val = s ? aici_var_get(s, NULL, NULL) : NULL;
        free(s);
        if (!val) return 0;
        free(val);
    }
    return 1;
}

static void do_set(aici_json body) {
    aici_json v;
    char *name = str_field(body, "var");
    uint32_t n;
    aici_json_get(body, "value", &v);
    char *val = expand(v, &n);
    if (aici_json_get(body, "append", &v) && aici_json_type(v) == AICI_J_TRUE) aici_var_append(name, val, n);
    else aici_var_set(name, val, n);
    free(val);
    free(name);
}

/* Runs the steps that take no generation step (Set, satisfied Wait, finished frames) and returns the kind of
 * the current step, with its body. */
static int settle(aici_json *body) {
    for (;;) {
        while (n_frames && frames[n_frames - 1].idx >= aici_json_len(frames[n_frames - 1].steps)) n_frames--;
        if (!n_frames) return K_END;
        frame *f = &frames[n_frames - 1];
        aici_json step;
        nth(f->steps, f->idx, &step);
        int k = step_kind(step, body);
        if (k == K_SET) do_set(*body);
        else if (k == K_WAIT && vars_ready(*body)) wait_steps = 0;
        else return k;
        f->idx++;
    }
}

static void finish_gen(void) {
    char *var = str_field(gen_body, "set_var");
    if (var) {
        uint32_t n;
        char *text = aici_gen_text(&gen, &n);
        aici_var_set(var, text, n);
        free(text);
        free(var);
    }
    if (gen.ended_by_eos) pending_backtrack = 1;
    set_label(gen_body, aici_n_tokens - pending_backtrack);
    aici_gen_free(&gen);
    gen_active = 0;
    frames[n_frames - 1].idx++;
}

static void init_prompt(const uint32_t *prompt, uint32_t n) {
    uint32_t len;
    aici_json arg, steps;
    arg_text = (char *)aici_read_blob(aici_host_module_arg(), &len);
    if (!aici_json_parse(arg_text, len, &arg) || !aici_json_get(arg, "steps", &steps))
        fail("controller_arg must be a JSON object {\"steps\": [...]}", NULL);
    validate(steps, 0);
    frames[0] = (frame){steps, 0};
    n_frames = 1;
}

static aici_pre_result pre_process(void) {
    aici_json body, branches;
    switch (settle(&body)) {
    case K_END:
    case K_STOP:
        return aici_pre_stop();
    case K_WAIT: {
        aici_json v;
        int64_t limit = 1000;
        if (aici_json_get(body, "max_steps", &v)) aici_json_int(v, &limit);
        if (++wait_steps > (uint64_t)limit) fail("Wait gave up: its variables were not set within max_steps steps", NULL);
        return aici_pre_suspend();
    }
    case K_FORK:
        if (!aici_config("fork")) fail("Fork needs the host's \"fork\" capability, which is off", NULL);
        aici_json_get(body, "branches", &branches);
        fork_pending = 1;
        return aici_pre_fork(aici_json_len(branches));
    default:
        return aici_pre_continue();
    }
}

static aici_mid_result noop(void) {
    uint32_t bt = pending_backtrack;
    pending_backtrack = 0;
    return aici_mid_splice(bt, NULL, 0);
}

static aici_mid_result mid_process(const uint32_t *fork_group, uint32_t n) {
    aici_json body, branches, branch;
    if (fork_pending) {
        fork_pending = 0;
        settle(&body);
        int i = aici_fork_index(fork_group, n);
        aici_json_get(body, "branches", &branches);
        if (i < 0 || !nth(branches, (uint32_t)i, &branch)) nth(branches, 0, &branch);
        frames[n_frames - 1].idx++;
        if (n_frames == MAX_FRAMES) fail("forks nested too deeply", NULL);
        frames[n_frames++] = (frame){branch, 0};
    }
    for (;;) {
        int k = settle(&body);
        switch (k) {
        case K_END:
        case K_STOP:
            return aici_mid_stop();
        case K_WAIT:
        case K_FORK:
            return noop();   /* the next pre_process suspends or forks */
        case K_FIXED: {
            aici_json text, following;
            uint32_t len, bt = pending_backtrack;
            if (aici_json_get(body, "following", &following)) {
                char *name = aici_json_str(following, NULL);
                int li = name ? label_index(name) : -1;
                if (li < 0) fail("Fixed follows an unknown label", name);
                uint32_t pos = label_pos[li];
                free(name);
                if (pos < aici_n_tokens) bt = aici_n_tokens - pos;
                if (bt && !aici_config("backtrack"))
                    fail("following needs the host's \"backtrack\" capability, which is off", NULL);
            }
            drop_labels_after(aici_n_tokens - bt);
            aici_json_get(body, "text", &text);
            char *s = expand(text, &len);
            free(ff);
            ff = aici_tokenize(s, len, &n);
            free(s);
            frames[n_frames - 1].idx++;
            pending_backtrack = 0;
            set_label(body, aici_n_tokens - bt + n);
            return aici_mid_splice(bt, ff, n);
        }
        default: {   /* Gen, Choose */
            if (!gen_active) {
                const char *err = "bad generation spec";
                if (!aici_gen_init(&gen, body, &err)) fail(KIND_NAMES[k], err);
                gen.start = aici_n_tokens - pending_backtrack;
                gen_body = body;
                gen_active = 1;
                if (pending_backtrack) return noop();
            }
            aici_mid_result r = aici_gen_mid(&gen);
            if (r.kind != AICI_MID_STOP) return r;
            finish_gen();
        }
        }
    }
}

static int post_process(const uint32_t *tokens, uint32_t n, uint32_t backtrack) {
    aici_json body;
    if (gen_active && aici_gen_post(&gen, tokens, n)) finish_gen();
    int k = settle(&body);
    return k == K_END || (k == K_STOP && !pending_backtrack);
}

static const aici_ctrl ctrl = {init_prompt, pre_process, mid_process, post_process};
const aici_ctrl *aici_controller(void) { return &ctrl; }
