/* concept_guard: keeps a readout concept below a threshold by steering against it.
 * Module arg {"concept": name, "threshold": t, "scale": s}: after every step it reads the last fed position's readout
 * of the concept (the mean over the readout layers); while that is above t it steers the sequence with the concept's
 * own direction at scale -|s| ("concept:<name>" at the readout layers), and it releases the steering once the
 * readout is back at or below t. It logs "concept_guard: <readout> on|off" per step (on: steering from now on) and
 * stops at EOS. A concept the worker does not read out stops the sequence before its first token. */
#include "aici.h"

static char *concept;
static double threshold, scale;
static int32_t concept_index = -2;   /* its place in the readout; -2: not looked up yet */
static uint32_t n_layers, n_concepts;
static float *readout;
static int steering;

static int number(aici_json arg, const char *key, double *out) {
    aici_json v;
    return aici_json_get(arg, key, &v) && aici_json_f64(v, out);
}

static void init_prompt(const uint32_t *prompt, uint32_t n) {
    uint32_t len;
    const char *text = (const char *)aici_read_blob(aici_host_module_arg(), &len);
    aici_json arg, name;
    if (!aici_json_parse(text, len, &arg) || !aici_json_get(arg, "concept", &name) ||
        !(concept = aici_json_str(name, &len)) || !number(arg, "threshold", &threshold) || !number(arg, "scale", &scale)) {
        aici_logs("concept_guard: the module arg must be {\"concept\": name, \"threshold\": t, \"scale\": s}\n");
        aici_host_stop();
    }
    if (scale > 0) scale = -scale;
    aici_readout(NULL, 0);   /* a readout at every step from the prompt's last one on */
}

static aici_mid_result mid_process(const uint32_t *fork_group, uint32_t n) {
    if (concept_index == -2) {
        concept_index = aici_readout_concept(concept, &n_layers, &n_concepts);
        if (concept_index >= 0) readout = malloc(n_layers * n_concepts * sizeof(float));
    }
    return concept_index < 0 ? aici_mid_stop() : aici_mid_sample();
}

static int post_process(const uint32_t *tokens, uint32_t n, uint32_t backtrack) {
    for (uint32_t i = 0; i < n; i++)
        if (tokens[i] == aici_eos()) return 1;
    if (!readout || aici_readout(readout, n_layers * n_concepts) != n_layers * n_concepts) return 0;
    double value = 0;
    for (uint32_t l = 0; l < n_layers; l++) value += readout[l * n_concepts + (uint32_t)concept_index];
    value /= n_layers;
    int over = value > threshold;
    if (over != steering && aici_steer_concept(concept, over ? scale : 0) == 0) steering = over;
    aici_buf b = {0};
    aici_buf_puts(&b, "concept_guard: ");
    aici_buf_f64(&b, value);
    aici_buf_puts(&b, steering ? " on\n" : " off\n");
    aici_log(b.p, b.n);
    aici_buf_free(&b);
    return 0;
}

static const aici_ctrl ctrl = {init_prompt, NULL, mid_process, post_process};
const aici_ctrl *aici_controller(void) { return &ctrl; }
